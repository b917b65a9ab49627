"""`[policy]` and `[audit]` in the config file, read by `quicedge serve`'s settings loader, reach
the wiring; bad values are named; the flags exist."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from edge.audit import AuditConfig
from edge.config import ProxyConfig
from edge.policy.config import PolicyConfig
from edge.serve import build_parser, load_settings
from edge.wiring import build

EXAMPLE = Path(__file__).parents[3] / "edge" / "policy" / "examples" / "deny_keyword.wasm"


def loaded(tmp_path: Path, text: str, *argv: str, env: dict[str, str] | None = None) -> Any:
    path = tmp_path / "quicedge.toml"
    path.write_text('[proxy]\nbackends = ["http://127.0.0.1:9"]\n' + text)
    args = build_parser().parse_args(["--config", str(path), *argv])
    return load_settings(args, env or {})


async def test_toml_tables_build_the_gateway_and_the_audit_log(tmp_path: Path) -> None:
    settings = loaded(
        tmp_path,
        f"""
[policy]
stream_lookbehind = 64

[[policy.rules]]
id = "no-secrets"
patterns = ["password"]

[[policy.wasm]]
id = "kw"
path = "{EXAMPLE}"
on_error = "open"

[[policy.stream_rules]]
id = "leak"
patterns = ["BEGIN PRIVATE KEY"]
literal = true

[policy.judge]
backends = ["http://127.0.0.1:9"]
mode = "race"

[audit]
path = "{tmp_path / "audit.jsonl"}"
when_full = "refuse"
""",
    )
    policy, audit = settings.get("policy", PolicyConfig), settings.get("audit", AuditConfig)
    assert [r.id for r in policy.rules] == ["no-secrets"]
    assert policy.wasm[0].on_error == "open" and policy.judge.mode == "race"
    assert audit.when_full == "refuse"
    wiring = await build(
        settings.get("proxy", ProxyConfig), registry=CollectorRegistry(), policies=policy,
        audit=audit,
    )  # fmt: skip
    try:
        assert wiring.gateway is not None and len(wiring.gateway.modules) == 1
        assert wiring.gateway.stream is not None and wiring.gateway.stream.lookbehind == 64
        assert wiring.gateway.judge is not None
        assert wiring.audit is not None
    finally:
        await wiring.aclose()


def test_flags_and_environment(tmp_path: Path) -> None:
    log = str(tmp_path / "a.jsonl")
    env = {"QUICEDGE_AUDIT_WHEN_FULL": "refuse"}
    settings = loaded(tmp_path, "", "--audit-log", log, "--policy-stream-hold", env=env)
    assert settings.get("audit", AuditConfig).path == str(tmp_path / "a.jsonl")
    assert settings.get("audit", AuditConfig).when_full == "refuse"
    assert settings.get("policy", PolicyConfig).stream_hold is True


async def test_no_tables_build_nothing(tmp_path: Path) -> None:
    settings = loaded(tmp_path, "")
    wiring = await build(
        settings.get("proxy", ProxyConfig), registry=CollectorRegistry(),
        policies=settings.get("policy", PolicyConfig), audit=settings.get("audit", AuditConfig),
    )  # fmt: skip
    try:
        assert wiring.gateway is None and wiring.audit is None
    finally:
        await wiring.aclose()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[[policy.rules]]\nid = "x"\npatterns = ["("]\n', "policy.rules.patterns"),
        ('[[policy.wasm]]\nid = "m"\n', "policy.wasm.path"),
        ("[audit]\nqueue_size = 0\n", "audit.queue_size"),
        ('[[policy.rules]]\nid = "x"\npatterns = ["a"]\ncolour = 1\n', "colour"),
        ('[policy.judge]\nmode = "maybe"\n', "policy.judge.mode"),
    ],
)
def test_bad_tables_are_named(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        loaded(tmp_path, text)


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("https://127.0.0.1:9", "https upstreams are not supported"),
        ("http://127.0.0.1:99999", "the port must be a number in 1..65535"),
        ("http://127.0.0.1:abc", "the port must be a number in 1..65535"),
        ("http://127.0.0.1:9/v1", "no path"),
        ("http://127.0.0.1:9?x=1", "no query"),
        ("127.0.0.1:9", "must be http://HOST:PORT"),
        ("http://user:secret@127.0.0.1:9", "credentials"),
    ],
)
def test_a_bad_judge_backend_url_is_refused_at_load(tmp_path: Path, url: str, says: str) -> None:
    """Each of these made every guard call fail: with `on_error = "open"` every request went
    through unjudged, with `closed` every request was refused; neither said why at start."""
    with pytest.raises(ValueError, match="policy.judge.backends") as refused:
        loaded(tmp_path, f'[policy.judge]\nbackends = ["{url}"]\n')
    assert says in str(refused.value) and "secret" not in str(refused.value)


def test_a_judge_backend_url_is_kept_without_its_trailing_slash(tmp_path: Path) -> None:
    settings = loaded(tmp_path, '[policy.judge]\nbackends = ["http://127.0.0.1:9/"]\n')
    assert settings.get("policy", PolicyConfig).judge.backends == ["http://127.0.0.1:9"]


def test_example_toml_in_the_docs_loads() -> None:
    docs = (Path(__file__).parents[3] / "docs" / "policy.md").read_text()
    block = docs.split("```toml\n", 1)[1].split("```", 1)[0]
    PolicyConfig.from_mapping(tomllib.loads(block)["policy"])


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[[policy.rules]]\nid = "no\\nsecrets"\npatterns = ["a"]\n', r"policy.rules.id: 'no\\n"),
        ('[[policy.rules]]\nid = "x\\r"\npatterns = ["a"]\n', r"policy.rules.id: 'x\\r'"),
        ('[[policy.rules]]\nid = " x"\npatterns = ["a"]\n', r"policy.rules.id: ' x'"),
        ('[[policy.wasm]]\nid = "m\\u0000"\npath = "m.wasm"\n', r"policy.wasm.id: 'm\\x00'"),
        ('[[policy.stream_rules]]\nid = "s\\t"\npatterns = ["a"]\n', r"policy.stream_rules.id"),
        (
            '[[policy.tenant_models]]\ntenant = "t\\n"\nmodels = ["a"]\n',
            r"policy.tenant_models.tenant: 't\\n'",
        ),
        ('[[policy.tiers]]\ntier = "b\\n"\nmax_tokens = 1\n', r"policy.tiers.tier: 'b\\n'"),
    ],
)
def test_a_name_a_refusal_header_carries_must_fit_in_a_header(
    tmp_path: Path, text: str, message: str
) -> None:
    """Rule and module ids, tenants and tiers are named in `x-quicedge-policy-rule`: one with a
    line break or another control character broke every refusal it made (a 500), so it is
    refused when the config is read, naming the setting."""
    with pytest.raises(ValueError, match=message) as info:
        loaded(tmp_path, text)
    assert "header" in str(info.value)


@pytest.mark.parametrize(
    ("action", "pattern"),
    [("redact", "(secret)?"), ("deny", "a|"), ("deny", "x*"), ("redact", "\\b"), ("deny", "^")],
)
def test_a_request_rule_pattern_that_can_match_nothing_is_refused(
    tmp_path: Path, action: str, pattern: str
) -> None:
    """A pattern that can match the empty string matches every prompt: a `deny` rule refused
    every request, and a `redact` rule put its replacement between every two characters
    (`[REDACTED]h[REDACTED]i...`). Refused when loaded, as a stream rule's is."""
    escaped = pattern.replace("\\", "\\\\")
    text = f'[[policy.rules]]\nid = "r"\naction = "{action}"\npatterns = ["{escaped}"]\n'
    with pytest.raises(ValueError, match=r"policy.rules.patterns \(r\): .*empty string"):
        loaded(tmp_path, text)


@pytest.mark.parametrize(
    "pattern", ["^ignore previous", "password\\s*[:=]", "\\bkey\\b", "(api[_ -]?)?key$", "a+"]
)
def test_request_rule_patterns_that_need_a_character_load(tmp_path: Path, pattern: str) -> None:
    escaped = pattern.replace("\\", "\\\\")
    loaded(tmp_path, f'[[policy.rules]]\nid = "r"\npatterns = ["{escaped}"]\n')


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[[policy.tenant_models]]\ntenant = "t"\nmodels = ["small-*"]\n'
         '[[policy.tenant_models]]\ntenant = "t"\nmodels = ["big-*"]\n',
         "policy.tenant_models: tenant 't' is listed twice"),
        ('[[policy.tiers]]\ntier = "bronze"\nmax_tokens = 10\n'
         '[[policy.tiers]]\ntier = "bronze"\nmax_prompt_chars = 10\n',
         "policy.tiers: tier 'bronze' is listed twice"),
    ],
)  # fmt: skip
def test_a_tenant_or_tier_listed_twice_is_refused(tmp_path: Path, text: str, message: str) -> None:
    """The second table silently replaced the first (its models, or its limits: a tier's
    `max_tokens` dropped by a second table that sets only `max_prompt_chars`)."""
    with pytest.raises(ValueError, match=message):
        loaded(tmp_path, text)
