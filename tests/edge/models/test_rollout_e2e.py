"""Gray release end to end: a stable and a canary stand-in behind the edge. The split by header
and session, shadow pairs compared and fed to the drift windows, a variant with longer answers
held, a canary that errors rolled back, and the admin API."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from typing import Any

import httpx

from edge.admission.settings import AdmissionSettings, TenantSettings
from edge.admission.tenants import key_digest
from edge.models import ModelsConfig
from edge.models.config import BackendModel, DriftConfig, RolloutConfig
from edge.models.rollout import session_point
from edge.routing.breakers import BreakerConfig
from tests.edge.conftest import (
    Recorded,
    Reply,
    TinyUpstream,
    client,
    fast_config,
    health_ok,
    run_edge,
)
from tests.edge.models.test_pools_e2e import chat, netloc, sim, sims
from tests.helpers import wait_until


def rollout(**overrides: Any) -> RolloutConfig:
    values: dict[str, Any] = {"model": "m", "stable": "v1", "canary": "v2", "steps": [50.0],
                              "auto": False}  # fmt: skip
    values.update(overrides)
    return RolloutConfig(**values)


async def test_the_header_and_sessions_choose_the_version() -> None:
    async with sims(sim("m", model_version="v1"), sim("m", model_version="v2")) as (s1, s2):
        models = ModelsConfig(rollouts=[rollout()])
        async with (
            run_edge(fast_config([s1.url, s2.url]), models=models) as edge,
            client(edge) as http,
        ):
            by_header = {}
            for value in ("1", "0"):
                r = await http.post("/v1/chat/completions", json=chat("m"),
                                    headers={"x-canary": value})  # fmt: skip
                assert r.status_code == 200
                by_header[value] = r.headers["x-quicedge-backend"]
            assert by_header == {"1": netloc(s2), "0": netloc(s1)}
            for i in range(6):  # each session keeps one version, whichever it is
                got = set()
                for _ in range(4):
                    r = await http.post("/v1/chat/completions", json=chat("m"),
                                        headers={"x-session-id": f"user-{i}"})  # fmt: skip
                    got.add(r.headers["x-quicedge-backend"])
                assert len(got) == 1
            seen = Counter()
            for _ in range(40):
                r = await http.post("/v1/chat/completions", json=chat("m"))
                seen[r.headers["x-quicedge-backend"]] += 1
            assert set(seen) == {netloc(s1), netloc(s2)}  # 50 %: both, (1 - 2^-39)


async def test_a_listed_tenant_gets_the_canary_by_its_api_key_not_by_a_header() -> None:
    async with sims(sim("m", model_version="v1"), sim("m", model_version="v2")) as (s1, s2):
        models = ModelsConfig(rollouts=[rollout(steps=[1.0, 100.0], tenants=["beta-co"])])
        session = {"x-session-id": "s-3"}
        assert session_point(b"s-3") > 0.5  # on its own, this session is stable's at 1 %
        key = {"authorization": "Bearer sk-beta", **session}
        config = fast_config([s1.url, s2.url])
        config.admission = AdmissionSettings(tenants=[TenantSettings(
            name="beta-co", tier="gold", api_key_sha256=[key_digest("sk-beta")],
        )])  # fmt: skip
        async with run_edge(config, models=models) as edge, client(edge) as http:
            for _ in range(4):
                beta = await http.post("/v1/chat/completions", json=chat("m"),
                                       headers=key)  # fmt: skip
                assert beta.status_code == 200 and beta.headers["x-quicedge-backend"] == netloc(s2)
                # a header naming the tenant is the client's word: the share decides
                other = await http.post("/v1/chat/completions", json=chat("m"),
                                        headers={"x-tenant-id": "beta-co", **session})  # fmt: skip
                assert other.status_code == 200
                assert other.headers["x-quicedge-backend"] == netloc(s1)


async def test_identical_versions_shadow_pairs_agree_and_the_ramp_completes() -> None:
    async with sims(sim("m", model_version="v1"), sim("m", model_version="v2")) as (s1, s2):
        models = ModelsConfig(rollouts=[rollout(
            steps=[5.0, 50.0, 100.0], auto=True, step_requests=3, step_seconds=0,
            shadow_fraction=1.0, shadow_rate=1000, shadow_concurrency=8,
            drift=DriftConfig(window=30),
        )])  # fmt: skip
        async with (
            run_edge(fast_config([s1.url, s2.url]), models=models) as edge,
            client(edge) as http,
        ):
            ramp = edge.wiring.models.ramps["m"]
            shadow = edge.wiring.models.shadows["m"]
            body = {**chat("m"), "temperature": 0, "max_tokens": 12}
            sent = 0
            while (ramp.rollout.state == "ramping" or shadow.compared < 60) and sent < 600:
                r = await http.post("/v1/chat/completions", json=body,
                                    headers={"x-session-id": f"s{sent}"})  # fmt: skip
                assert r.status_code == 200
                sent += 1
                if ramp.rollout.state != "ramping" and ramp.rollout.percent >= 100:
                    # at 100 % nothing is stable any more: no mirrors; stop
                    break
            await wait_until(lambda: not shadow._tasks, timeout=20)
            assert ramp.rollout.state == "promoted", ramp.snapshot()
            assert [t.action for t in ramp.history][-1] == "promoted"
            assert all(t.action in ("advance", "promoted") for t in ramp.history)
            assert shadow.compared > 0
            assert shadow.last is not None and shadow.last.exact is True
            assert shadow.last.top1_agreement == 1.0 and shadow.last.length_ratio == 1.0
            async with httpx.AsyncClient() as admin:
                metrics = (await admin.get(edge.admin_url + "/metrics")).text
            assert (
                'quicedge_shadow_agreement_total{agree="true",check="exact",model="m"}' in metrics
            )
            assert 'quicedge_rollout_transitions_total{action="promoted",model="m"}' in metrics


async def test_a_variant_with_longer_answers_is_held_at_the_first_step_with_the_reason() -> None:
    base = {"natural_output_len": (10, 30)}
    async with sims(
        sim("m", model_version="v1", **base), sim("m", model_version="v2", variant="long", **base)
    ) as (s1, s2):
        models = ModelsConfig(rollouts=[rollout(
            steps=[5.0, 50.0, 100.0], auto=True, step_requests=10_000,
            shadow_fraction=1.0, shadow_rate=1000, shadow_concurrency=8,
            drift=DriftConfig(window=30),
        )])  # fmt: skip
        async with (
            run_edge(fast_config([s1.url, s2.url]), models=models) as edge,
            client(edge) as http,
        ):
            ramp = edge.wiring.models.ramps["m"]
            body = {**chat("m"), "max_tokens": 200}
            for i in range(400):
                if ramp.rollout.state != "ramping":
                    break
                r = await http.post("/v1/chat/completions", json=body, headers={"x-canary": "0"})
                assert r.status_code == 200
                if i % 8 == 7:  # let the mirrors finish: the limit drops the rest
                    await wait_until(lambda: not edge.wiring.models.shadows["m"]._tasks)
            assert ramp.rollout.state == "held", ramp.snapshot()
            assert ramp.rollout.percent == 5 and "mean length" in ramp.rollout.reason
            async with httpx.AsyncClient() as admin:
                state = (await admin.get(edge.admin_url + "/rollouts")).json()
            (shown,) = state["rollouts"]
            assert shown["state"] == "held" and "length" in shown["history"][-1]["reason"]


def _failing_canary(recorded: Recorded) -> Reply:
    known = health_ok(recorded)
    if known is not None:
        return known
    error = {"error": {"message": "boom", "type": "server_error", "code": 500}}
    return Reply(status=500, chunks=[json.dumps(error).encode()], chunked=False,
                 headers=[("content-type", "application/json")])  # fmt: skip


async def test_a_canary_that_errors_is_rolled_back_and_stable_serves_all() -> None:
    async with sims(sim("m", model_version="v1")) as (s1,), TinyUpstream(_failing_canary) as bad:
        models = ModelsConfig(
            backends=[BackendModel(bad.url, model="m", version="v2")],
            rollouts=[rollout(auto=True, step_requests=10_000)],
        )
        config = fast_config([s1.url, bad.url], eject_after_failures=1000)
        async with run_edge(config, models=models) as edge, client(edge) as http:
            ramp = edge.wiring.models.ramps["m"]
            statuses = Counter()
            for _ in range(400):
                if ramp.rollout.state == "rolled_back":
                    break
                r = await http.post("/v1/chat/completions", json=chat("m"))
                statuses[r.status_code] += 1
            assert ramp.rollout.state == "rolled_back", ramp.snapshot()
            assert "error rate" in ramp.rollout.reason and statuses[500] >= 20
            for _ in range(20):
                r = await http.post("/v1/chat/completions", json=chat("m"))
                assert r.status_code == 200 and r.headers["x-quicedge-backend"] == netloc(s1)


async def test_a_failing_canary_behind_its_open_breaker_is_still_rolled_back() -> None:
    """The canary is its own breaker domain (m@v2): its breaker opens after a few errors and
    hands its requests to stable, and those refusals count as canary errors for the ramp."""
    async with sims(sim("m", model_version="v1")) as (s1,), TinyUpstream(_failing_canary) as bad:
        models = ModelsConfig(
            backends=[BackendModel(bad.url, model="m", version="v2")],
            rollouts=[rollout(auto=True, step_requests=10_000, steps=[50.0, 100.0])],
        )
        breakers = BreakerConfig(window=10, min_requests=5, open_for=60.0)
        config = fast_config([s1.url, bad.url], eject_after_failures=1000)
        async with run_edge(config, models=models, breakers=breakers) as edge, \
                client(edge) as http:  # fmt: skip
            assert edge.wiring.breakers is not None
            ramp = edge.wiring.models.ramps["m"]
            statuses: Counter[int] = Counter()
            for _ in range(400):
                if ramp.rollout.state == "rolled_back":
                    break
                r = await http.post("/v1/chat/completions", json=chat("m"))
                statuses[r.status_code] += 1
            assert ramp.rollout.state == "rolled_back", ramp.snapshot()
            assert "error rate" in ramp.rollout.reason
            assert edge.wiring.breakers.state_of("m@v2", "bronze", "default") == "open"
            assert edge.wiring.breakers.state_of("m@v1", "bronze", "default") == "closed"
            # the clients saw the errors up to the breaker opening, not the ramp's 20
            assert 5 <= statuses[500] < 20, statuses
            assert set(statuses) == {200, 500}


async def test_the_admin_api_moves_a_rollout_and_refuses_what_it_cannot_do() -> None:
    async with sims(sim("m", model_version="v1"), sim("m", model_version="v2")) as (s1, s2):
        models = ModelsConfig(rollouts=[rollout(steps=[1.0, 10.0, 100.0])])
        async with run_edge(fast_config([s1.url, s2.url]), models=models) as edge:
            async with httpx.AsyncClient(base_url=edge.admin_url) as admin:
                state = (await admin.post("/rollouts/m/promote")).json()
                assert state["percent"] == 10 and state["state"] == "ramping"
                assert (await admin.post("/rollouts/m/pause")).json()["state"] == "paused"
                back = (await admin.post("/rollouts/m/rollback")).json()
                assert back["state"] == "rolled_back" and back["percent"] == 0
                refused = await admin.post("/rollouts/m/promote")
                assert (
                    refused.status_code == 400
                    and "rolled back" in refused.json()["error"]["message"]
                )
                assert (await admin.post("/rollouts/nope/pause")).status_code == 404
                assert (await admin.post("/rollouts/m/explode")).status_code == 404
                assert (await admin.get("/rollouts/m/pause")).status_code == 405
                listed = (await admin.get("/rollouts")).json()
                actions = [h["action"] for h in listed["rollouts"][0]["history"]]
                assert actions == ["advance", "pause", "rollback"]
                metrics = (await admin.get("/metrics")).text
                assert 'quicedge_rollout_canary_percent{model="m"} 0.0' in metrics
                restarted = (await admin.post("/rollouts/m/restart")).json()
                assert (restarted["state"], restarted["percent"]) == ("ramping", 1.0)
                assert (await admin.post("/rollouts/m/promote")).json()["percent"] == 10
                listed = (await admin.get("/rollouts")).json()
                actions = [h["action"] for h in listed["rollouts"][0]["history"]]
                assert actions == ["advance", "pause", "rollback", "restart", "advance"]
                metrics = (await admin.get("/metrics")).text
                assert 'quicedge_rollout_canary_percent{model="m"} 10.0' in metrics
                restarts = 'quicedge_rollout_transitions_total{action="restart",model="m"} 1.0'
                assert restarts in metrics


async def test_a_flatter_canary_pauses_at_the_first_step_on_its_top1_probability() -> None:
    """Mirrors are awaited one by one and the stand-ins are deterministic per prompt, so the
    windows hold the same samples on every run."""
    async with sims(sim("m", model_version="v1"), sim("m", model_version="v2", variant="flat")) as (
        s1,
        s2,
    ):
        models = ModelsConfig(rollouts=[rollout(
            steps=[1.0, 50.0, 100.0], auto=True, step_requests=10_000,
            shadow_fraction=1.0, shadow_rate=1000, drift=DriftConfig(window=100),
        )])  # fmt: skip
        async with (
            run_edge(fast_config([s1.url, s2.url]), models=models) as edge,
            client(edge) as http,
        ):
            ramp = edge.wiring.models.ramps["m"]
            shadow = edge.wiring.models.shadows["m"]
            for i in range(1500):
                # A flatter canary may also shift the entropy, which holds the ramp (share kept)
                # a window earlier on a loaded machine; pairs go on, and the top-1 shift then
                # pauses it.
                if ramp.rollout.state not in ("ramping", "held"):
                    break
                body = {"model": "m", "max_tokens": 16, "temperature": 0,
                        "messages": [{"role": "user", "content": f"question {i}"}]}  # fmt: skip
                r = await http.post("/v1/chat/completions", json=body, headers={"x-canary": "0"})
                assert r.status_code == 200
                await wait_until(lambda: not shadow._tasks, timeout=20)
            assert ramp.rollout.state == "paused", ramp.snapshot()
            assert ramp.rollout.percent == 1 and "top-1 probability" in ramp.rollout.reason
            assert shadow.last is not None and shadow.last.exact is True  # same text, flatter
            assert shadow.compared % 100 == 0  # it paused at the end of a window
            assert shadow.compared <= 500  # 200 with these prompts (docs/models.md)


async def test_a_shadow_never_delays_the_client_and_is_bounded() -> None:
    """The canary holds every mirror until released: the client's answers come back meanwhile,
    a second mirror finds the one slot taken, and one over the rate is dropped."""
    release = asyncio.Event()

    async def slow_canary(recorded: Recorded) -> Reply:
        known = health_ok(recorded)
        if known is not None:
            return known
        await release.wait()
        answer = {"choices": [{"message": {"content": "late"}, "finish_reason": "stop"}],
                  "usage": {"completion_tokens": 1}}  # fmt: skip
        return Reply(chunks=[json.dumps(answer).encode()], chunked=False,
                     headers=[("content-type", "application/json")])  # fmt: skip

    async with sims(sim("m", model_version="v1")) as (s1,), TinyUpstream(slow_canary) as canary:
        models = ModelsConfig(
            backends=[BackendModel(canary.url, model="m", version="v2")],
            rollouts=[
                rollout(
                    steps=[1e-6],
                    shadow_fraction=1.0,
                    shadow_concurrency=1,
                    shadow_rate=0.01,
                    shadow_timeout=30,
                )
            ],  # fmt: skip
        )
        async with (
            run_edge(fast_config([s1.url, canary.url]), models=models) as edge,
            client(edge) as http,
        ):
            shadow = edge.wiring.models.shadows["m"]
            for _ in range(4):
                r = await http.post("/v1/chat/completions", json=chat("m"),
                                    headers={"x-canary": "0"})  # fmt: skip
                assert r.status_code == 200 and r.headers["x-quicedge-backend"] == netloc(s1)
            assert len(shadow._tasks) == 1  # answered while the first mirror still waits
            async with httpx.AsyncClient() as admin:
                metrics = (await admin.get(edge.admin_url + "/metrics")).text
            assert 'quicedge_shadow_requests_total{model="m",result="dropped_full"} 3.0' in metrics
            release.set()
            await wait_until(lambda: shadow.compared == 1, timeout=20)
            assert shadow.last is not None and shadow.last.exact is None  # not greedy
            # the bucket (one token, then 0.01 a second) is empty: the next mirrors are dropped
            for _ in range(2):
                await http.post("/v1/chat/completions", json=chat("m"), headers={"x-canary": "0"})
                await wait_until(lambda: not shadow._tasks, timeout=20)
            async with httpx.AsyncClient() as admin:
                metrics = (await admin.get(edge.admin_url + "/metrics")).text
            dropped = 'quicedge_shadow_requests_total{model="m",result="dropped_rate"} 2.0'
            assert dropped in metrics and shadow.compared == 1


async def test_no_mirror_goes_to_a_canary_that_is_queueing() -> None:
    def queueing_canary(recorded: Recorded) -> Reply:
        if recorded.path in ("/v1/loads", "/get_load"):
            load = {"num_running_reqs": 8, "num_waiting_reqs": 5, "num_total_tokens": 0,
                    "token_usage": 0.5, "max_total_tokens": 100000}  # fmt: skip
            return Reply(chunks=[json.dumps({"loads": [load]}).encode()], chunked=False,
                         headers=[("content-type", "application/json")])  # fmt: skip
        known = health_ok(recorded)
        assert known is not None, recorded.path  # no mirror may reach it
        return known

    async with sims(sim("m", model_version="v1")) as (s1,), TinyUpstream(queueing_canary) as busy:
        models = ModelsConfig(
            backends=[BackendModel(busy.url, model="m", version="v2")],
            rollouts=[rollout(steps=[1e-6], shadow_fraction=1.0)],
        )
        async with (
            run_edge(fast_config([s1.url, busy.url]), models=models) as edge,
            client(edge) as http,
        ):
            b = edge.wiring.registry.get(netloc(busy))
            assert b is not None
            await wait_until(lambda: b.load is not None and b.load.num_waiting_reqs > 0)
            for _ in range(3):
                r = await http.post("/v1/chat/completions", json=chat("m"),
                                    headers={"x-canary": "0"})  # fmt: skip
                assert r.status_code == 200
            async with httpx.AsyncClient() as admin:
                metrics = (await admin.get(edge.admin_url + "/metrics")).text
            assert 'quicedge_shadow_requests_total{model="m",result="canary_busy"} 3.0' in metrics
            assert not [r for r in busy.requests if r.path.startswith("/v1/chat")]


async def test_requests_the_guard_model_refuses_are_no_canary_errors() -> None:
    """`[policy.judge] mode = "race"`: an unsafe prompt is cancelled while the canary is still
    preparing its answer. The refusal is the prompt's, not the canary's: the ramp does not
    count it, and a canary that has failed no one is not rolled back."""
    from edge.policy.config import PolicyConfig
    from tests.edge.policy.test_judge import backend, sim_guard

    async with (
        sims(sim("m", model_version="v1")) as (s1,),
        TinyUpstream(backend(head_delay=5.0)) as slow,
        sim_guard() as guard,
    ):
        models = ModelsConfig(
            backends=[BackendModel(slow.url, model="m", version="v2")],
            rollouts=[rollout(auto=True, step_requests=10_000)],
        )
        policies = PolicyConfig.from_mapping({"judge": {"backends": [guard.url], "mode": "race"}})
        config = fast_config([s1.url, slow.url], eject_after_failures=1000)
        async with (
            run_edge(config, models=models, policies=policies) as edge,
            client(edge) as http,
        ):
            ramp = edge.wiring.models.ramps["m"]
            canary = edge.wiring.registry.get(netloc(slow))
            assert canary is not None
            await wait_until(lambda: canary.healthy and canary.model_version == "v2")
            body = {"model": "m", "prompt": "plan an attack", "stream": True}
            for i in range(25):
                r = await http.post("/v1/completions", json=body, headers={"x-canary": "1"})
                assert r.status_code == 200 and b"content_filter" in r.content, (i, ramp.snapshot())
            await wait_until(
                lambda: sum(q.path == "/abort_request" for q in slow.requests) == 25, timeout=20
            )
            assert ramp.rollout.state == "ramping", ramp.snapshot()
            assert ramp.error_rate() == 0.0


async def test_a_rollout_whose_header_rule_is_off_ignores_the_header() -> None:
    """`header = "none"` in TOML (which has no null): no client chooses its version by header;
    at a share of almost nothing, every request goes to stable."""
    async with sims(sim("m", model_version="v1"), sim("m", model_version="v2")) as (s1, s2):
        loaded = ModelsConfig.from_mapping({"rollouts": [{
            "model": "m", "stable": "v1", "canary": "v2", "steps": [1e-6], "header": "none",
        }]})  # fmt: skip
        async with (
            run_edge(fast_config([s1.url, s2.url]), models=loaded) as edge,
            client(edge) as http,
        ):
            for _ in range(3):
                r = await http.post("/v1/chat/completions", json=chat("m"),
                                    headers={"x-canary": "1"})  # fmt: skip
                assert r.status_code == 200 and r.headers["x-quicedge-backend"] == netloc(s1)
