"""Admission settings from TOML and the tenant directory (API key digests → tenants)."""

from __future__ import annotations

import re
import tomllib

import pytest

from edge.admission.settings import AdmissionSettings
from edge.admission.tenants import TenantDirectory, key_digest
from edge.errors import Unauthorized

DOC = f"""
[admission.anonymous]
requests_per_second = 2.0

[admission.redis]
url = "redis://127.0.0.1:6379/0"
fallback_share = 0.5

[[tenants]]
name = "acme"
tier = "gold"
api_key_sha256 = ["{key_digest("sk-acme")}"]
requests_per_second = 5.0
burst = 10
tokens_per_minute = 200000
max_concurrent = 32

[[tenants]]
name = "tiny"
api_key_sha256 = ["{key_digest("sk-tiny-1")}", "{key_digest("sk-tiny-2")}"]
tokens_per_minute = 600
"""


def test_the_issue_toml_shape_loads() -> None:
    settings = AdmissionSettings.from_toml(tomllib.loads(DOC))
    acme, tiny = settings.tenants
    assert (acme.name, acme.tier, acme.requests_per_second, acme.burst) == ("acme", "gold", 5.0, 10)
    assert (acme.tokens_per_minute, acme.max_concurrent) == (200000, 32)
    assert tiny.tier == "bronze" and tiny.requests_per_second is None
    assert settings.redis.fallback_share == 0.5
    assert settings.anonymous.enabled and settings.anonymous.requests_per_second == 2.0


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ('[[tenants]]\nname = "a"\ntier = "platinum"', "tenants[0].tier"),
        ('[[tenants]]\nname = "a"\napi_key_sha256 = ["sk-plain-key"]', "api_key_sha256"),
        ('[[tenants]]\nname = "a"\nrps = 3', "tenants[0]: unknown setting(s) rps"),
        ('[[tenants]]\nname = "a"\n[[tenants]]\nname = "a"', "is taken"),
        ('[[tenants]]\nname = "anonymous"', "is taken"),
        ('[[tenants]]\nname = "a"\nburst = 3', "burst: needs requests_per_second"),
        ('[[tenants]]\nname = "a"\nrequests_per_second = "fast"', "must be a number"),
        # TOML reads both: inf overflowed the burst's rounding, nan made a bucket that always
        # admits
        ('[[tenants]]\nname = "a"\nrequests_per_second = inf', "requests_per_second: must be"),
        ('[[tenants]]\nname = "a"\nrequests_per_second = nan', "requests_per_second: must be"),
        ("[admission.anonymous]\nrequests_per_second = inf", "requests_per_second: must be"),
        ("[admission.redis]\nfallback_share = 0", "fallback_share"),
        ("[admission.throttle]\nmax_queue_depth = 0", "max_queue_depth"),
        ("[admission]\nanonymus = {}", "admission: unknown setting(s) anonymus"),
    ],
)
def test_bad_settings_name_the_key(doc: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        AdmissionSettings.from_toml(tomllib.loads(doc))


def test_keys_map_to_tenants_and_the_rest_is_401() -> None:
    directory = TenantDirectory(AdmissionSettings.from_toml(tomllib.loads(DOC)))
    acme = directory.identify(b"Bearer sk-acme")
    assert (acme.name, acme.tier, acme.rank) == ("acme", "gold", 0)
    assert acme.requests is not None and acme.requests.capacity == 10
    assert acme.tokens is not None and acme.tokens.rate == pytest.approx(200000 / 60)
    assert directory.identify(b"bearer  sk-tiny-2").name == "tiny"
    assert directory.identify(None).name == "anonymous"
    for bad in (b"Bearer sk-nope", b"Basic c2stYWNtZQ==", b"Bearer ", b"sk-acme"):
        with pytest.raises(Unauthorized) as info:
            directory.identify(bad)
        assert info.value.status == 401
        assert info.value.payload()["error"]["code"] == "invalid_api_key"  # type: ignore[index]


def test_anonymous_off_means_a_missing_key_is_401() -> None:
    settings = AdmissionSettings.from_toml(
        tomllib.loads(DOC.replace("requests_per_second = 2.0", "enabled = false"))
    )
    assert not settings.anonymous.enabled
    directory = TenantDirectory(settings)
    with pytest.raises(Unauthorized, match="didn't provide an API key"):
        directory.identify(None)
    assert directory.identify(b"Bearer sk-acme").name == "acme"


def test_no_key_is_kept_in_clear() -> None:
    directory = TenantDirectory(AdmissionSettings.from_toml(tomllib.loads(DOC)))
    assert "sk-acme" not in repr(vars(directory))


def test_serve_reads_admission_and_tenants_from_its_toml() -> None:
    from edge import serve
    from edge.config import ProxyConfig

    args = serve.build_parser().parse_args([])
    doc = tomllib.loads('[proxy]\nbackends = ["http://127.0.0.1:1"]\n' + DOC)
    config = serve.load_settings(args, {}, toml=doc).get("proxy", ProxyConfig)
    assert [t.name for t in config.admission.tenants] == ["acme", "tiny"]
    assert config.admission.redis.fallback_share == 0.5
    with pytest.raises(ValueError, match="tier"):
        serve.load_settings(args, {}, toml={**doc, "tenants": [{"name": "x", "tier": "iron"}]})
    with pytest.raises(ValueError, match="unknown"):
        serve.load_settings(args, {}, toml={**doc, "proxy": {**doc["proxy"], "admission": {}}})
    twice = [{"name": "x", "tier": "gold"}, {"name": "x", "tier": "gold"}]
    with pytest.raises(ValueError, match="tenants"):
        serve.load_settings(args, {}, toml={**doc, "tenants": twice})


def test_the_default_burst_is_the_rate_rounded_up_and_at_least_one() -> None:
    doc = "\n".join(
        f'[[tenants]]\nname = "t{i}"\nrequests_per_second = {rps}'
        for i, rps in enumerate((0.2, 2.5, 4.0))
    )
    directory = TenantDirectory(AdmissionSettings.from_toml(tomllib.loads(doc)))
    assert [t.requests.capacity for t in directory.tenants if t.requests] == [1.0, 3.0, 4.0]
