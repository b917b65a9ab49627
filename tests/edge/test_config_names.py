"""Names one table gives that another must know: a `[[policy.tiers]]` tier, a tenant of
`[[policy.tenant_models]]`, of a rule or of a rollout, a route of `[policy.judge]` or
`[state.cache]`. A name nothing else gives (`tier = "free"`, a tenant's name or a route
mistyped) was accepted, and its limit, allow-list, rule, canary, guard or cache then held no
request, without a word. Refused at load, at start and on a reload alike, naming the setting."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest

from edge.reload import Reloader
from edge.serve import build_parser, load_settings
from edge.settings import SettingsError
from tests.edge.conftest import TinyUpstream, client, fast_config, run_edge
from tests.edge.state.helpers import ChatUpstream

BACKEND = '[proxy]\nbackends = ["http://127.0.0.1:9"]\n'


def tenant(name: str) -> str:
    digest = hashlib.sha256(f"key-{name}".encode()).hexdigest()
    return f'[[tenants]]\nname = "{name}"\napi_key_sha256 = ["{digest}"]\n'


def load(tmp_path: Path, text: str) -> Any:
    path = tmp_path / "quicedge.toml"
    path.write_text(BACKEND + text)
    return load_settings(build_parser().parse_args(["--config", str(path)]), {})


TIER = ('[[policy.tiers]]\ntier = "free"\nmax_tokens = 10\n', "policy.tiers.tier: 'free' is not")
MODELS = (
    tenant("acme-co") + '[[policy.tenant_models]]\ntenant = "acme"\nmodels = ["small-*"]\n',
    "policy.tenant_models.tenant: 'acme' is not a tenant",
)
REFUSED = [
    TIER,
    MODELS,
    (
        tenant("acme-co") + '[[policy.rules]]\nid = "r"\npatterns = ["x"]\ntenants = ["acme"]\n',
        "policy.rules.tenants (r): 'acme' is not a tenant",
    ),
    (
        '[policy.judge]\nbackends = ["http://127.0.0.1:9"]\nroutes = ["/v1/chat/completion"]\n',
        "policy.judge.routes: '/v1/chat/completion' is not an inference route",
    ),
    (
        tenant("beta-testers")
        + '[[models.rollouts]]\nmodel = "m"\nstable = "v1"\ncanary = "v2"\ntenants = ["beta"]\n',
        "models.rollouts[0].tenants: 'beta' is not a tenant",
    ),
    (
        '[state.cache]\nallow_tenants = ["*"]\nroutes = ["/v1/chat/completion"]\n',
        "state.cache.routes: '/v1/chat/completion' is not a cached route",
    ),
]


@pytest.mark.parametrize(("text", "message"), REFUSED)
def test_a_name_nothing_gives_is_refused_at_load(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(SettingsError) as info:
        load(tmp_path, text)
    assert str(info.value).startswith(message), str(info.value)


@pytest.mark.parametrize(
    "text",
    [
        '[[policy.tiers]]\ntier = "bronze"\nmax_tokens = 10\n',
        '[[policy.tenant_models]]\ntenant = "anonymous"\nmodels = ["small-*"]\n',
        tenant("acme") + '[[policy.tenant_models]]\ntenant = "acme"\nmodels = ["small-*"]\n',
        tenant("acme") + '[[policy.rules]]\nid = "r"\npatterns = ["x"]\ntenants = ["acme"]\n',
        '[policy.judge]\nbackends = ["http://127.0.0.1:9"]\nroutes = ["/v1/responses"]\n',
        tenant("beta")
        + '[[models.rollouts]]\nmodel = "m"\nstable = "v1"\ncanary = "v2"\ntenants = ["beta"]\n',
        '[state.cache]\nallow_tenants = ["*"]\nroutes = ["/generate", "/v1/completions"]\n',
    ],
)
def test_a_name_that_is_given_loads(tmp_path: Path, text: str) -> None:
    load(tmp_path, text)


def test_the_checked_routes_are_the_ones_served() -> None:
    from edge.app import INFERENCE_ROUTES as served
    from edge.policy.config import INFERENCE_ROUTES
    from edge.state.config import CACHEABLE_ROUTES
    from edge.state.stage import CACHEABLE_ROUTES as cached

    assert set(served) == INFERENCE_ROUTES
    assert cached == CACHEABLE_ROUTES


async def test_a_reload_refuses_them_and_the_running_settings_serve_on(tmp_path: Path) -> None:
    path = tmp_path / "quicedge.toml"
    path.write_text("")
    async with (
        TinyUpstream(ChatUpstream()) as up,
        run_edge(fast_config([up.url])) as edge,
        client(edge) as http,
    ):

        def read() -> Any:
            args = build_parser().parse_args(["--config", str(path), "--backend", up.url])
            return load_settings(args, {})

        reloader = Reloader(read, read(), edge.wiring)
        body = {"model": "default", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}
        for text, message in (TIER, MODELS):
            path.write_text(text)
            report = await reloader.reload_reported()
            assert report["outcome"] == "refused" and report["changed"] == [], report
            assert report["error"].startswith(message), report
            assert (await http.post("/v1/chat/completions", json=body)).status_code == 200
        await reloader.aclose()
