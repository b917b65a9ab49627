"""Half-open probes through the edge: a probe that fails before anything reached the client
and is retried within its own domain is settled with the request, as a closed domain's
attempts are."""

from __future__ import annotations

import asyncio

import httpx

from edge.routing.breakers import BreakerConfig
from tests.edge.conftest import (
    Recorded,
    Reply,
    Script,
    TinyUpstream,
    client,
    fast_config,
    health_ok,
    run_edge,
    sse_reply,
)
from tests.helpers import wait_until

CHAT = {"model": "tiny-model", "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4, "stream": True}  # fmt: skip


def answering(status: dict[str, int], name: str) -> Script:
    """A healthy upstream whose inference answers are `status[name]` (200: a short stream)."""

    def answer(recorded: Recorded) -> Reply:
        reply = health_ok(recorded)
        if reply is not None:
            return reply
        if status[name] != 200:
            return Reply(status=status[name], chunks=[b'{"error": "boom"}'], chunked=False)
        return sse_reply(["ok"])

    return answer


async def test_a_probe_retried_and_served_in_its_own_domain_is_no_failed_probe() -> None:
    status = {"bad": 500, "good": 500}
    # three successes to close: a probe's failed first attempt is settled while half-open
    breakers = BreakerConfig(window=4, min_requests=4, open_for=0.2, half_open_probes=3)
    async with TinyUpstream(answering(status, "bad")) as bad, \
            TinyUpstream(answering(status, "good")) as good:  # fmt: skip
        # one domain, two backends: a 503 is retried on the other one, a 500 is answered
        config = fast_config([bad.url, good.url], eject_after_failures=1000, max_retries=1)
        async with run_edge(config, breakers=breakers) as edge, client(edge) as http:
            domains = edge.wiring.breakers
            assert domains is not None
            # the model learned from /v1/models places both in one domain before any request
            await wait_until(lambda: all(b.model == "tiny-model" for b in domains.backends))

            def state() -> str | None:
                return domains.state_of("tiny-model", "bronze", "default")

            for _ in range(4):
                assert (await http.post("/v1/chat/completions", json=CHAT)).status_code == 500
            assert state() == "open"
            status.update(bad=503, good=200)
            await asyncio.sleep(0.3)  # past the open period: the next request probes
            refused_before = sum(r.path == "/v1/chat/completions" for r in bad.requests)
            for _ in range(6):
                response = await http.post("/v1/chat/completions", json=CHAT)
                assert response.status_code == 200
                if state() == "closed":
                    break
            assert state() == "closed"
            # some probe went to the refusing backend first, and was retried on the other
            assert sum(r.path == "/v1/chat/completions" for r in bad.requests) > refused_before
            async with httpx.AsyncClient(base_url=edge.admin_url) as admin:
                metrics = (await admin.get("/metrics")).text
            opened = [
                line for line in metrics.splitlines()
                if line.startswith("quicedge_breaker_transitions_total")
                and 'to="open"' in line and 'tier="bronze"' in line
            ]  # fmt: skip
            # opened once, by the 500s: no retried 503 opened it again while it probed
            assert [float(line.split()[-1]) for line in opened] == [1.0], opened


async def test_a_probe_whose_observer_raises_still_reports_to_its_breaker() -> None:
    """The attempt's last reports run in one `finally`: the breaker's came after the routing
    policy's and an await, so an observer that raised (or a second cancellation during the
    close) kept the probe's slot, and the domain refused every request for good."""
    status = {"up": 500}
    breakers = BreakerConfig(window=4, min_requests=4, open_for=0.2, half_open_probes=1)
    async with TinyUpstream(answering(status, "up")) as up:
        config = fast_config([up.url], eject_after_failures=1000, max_retries=0)
        async with run_edge(config, breakers=breakers) as edge, client(edge) as http:
            domains = edge.wiring.breakers
            assert domains is not None
            await wait_until(lambda: all(b.model == "tiny-model" for b in domains.backends))
            for _ in range(4):
                assert (await http.post("/v1/chat/completions", json=CHAT)).status_code == 500
            assert domains.state_of("tiny-model", "bronze", "default") == "open"
            status["up"] = 200
            policy = edge.wiring.app.attempts.policy
            observe = policy.observe
            raised: list[bool] = []

            def observe_once_failing(outcome: object) -> None:
                if not raised:
                    raised.append(True)
                    raise RuntimeError("an observer's bug")
                observe(outcome)  # type: ignore[arg-type]

            policy.observe = observe_once_failing  # type: ignore[method-assign]
            await asyncio.sleep(0.3)  # past the open period: the next request probes
            await http.post("/v1/chat/completions", json=CHAT)  # the probe: answered, then raised
            assert raised
            assert domains.state_of("tiny-model", "bronze", "default") == "closed"
            assert (await http.post("/v1/chat/completions", json=CHAT)).status_code == 200
