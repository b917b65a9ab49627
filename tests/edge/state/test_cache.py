"""The response cache end to end: L1 in the edge, L2 in real Redis shared by a second edge, the
stand-in or a scripted upstream behind; what is never cached; the byte bound."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from backends.sim import SimServer
from edge.models import ModelsConfig
from edge.models.config import Alias
from edge.policy.config import PolicyConfig
from edge.policy.gateway import PolicyGateway
from edge.state.cache import Entry, ResponseCache
from edge.state.config import CacheConfig
from tests.edge.conftest import (
    Reply,
    TinyUpstream,
    client,
    fast_config,
    health_ok,
    run_edge,
    sse_reply,
)
from tests.edge.models.test_pools_e2e import netloc, sim, sims
from tests.edge.models.test_rollout_e2e import rollout
from tests.edge.state.helpers import (
    CHAT,
    ChatUpstream,
    as_tenant,
    chat_chunks,
    chat_whole,
    state,
    tenants,
)
from tests.edge.test_app_sim import sim_config
from tests.helpers import RedisServer

USE = {"x-quicedge-cache": "use"}
GREEDY = {"model": "default", "messages": [{"role": "user", "content": "Cache me"}],
          "max_tokens": 8, "temperature": 0}  # fmt: skip


async def metrics(edge: Any) -> str:
    async with httpx.AsyncClient() as http:
        return (await http.get(edge.admin_url + "/metrics")).text


def count(text: str, tier: str, outcome: str) -> float:
    line = f'quicedge_cache_requests_total{{outcome="{outcome}",tier="{tier}"}}'
    for row in text.splitlines():
        if row.startswith(line + " "):
            return float(row.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
async def test_miss_then_l1_then_l2_from_a_second_edge(
    stream: bool, redis_url: str, redis_prefix: str
) -> None:
    settings = state(redis_url, redis_prefix, cache={"allow_tenants": ["*"]})
    async with SimServer(sim_config("b1")) as sim:
        config = fast_config([sim.url], state=settings)
        async with run_edge(config) as a, run_edge(config) as b:
            async with client(a) as ha, client(b) as hb:
                body = {**GREEDY, "stream": stream}
                miss = await ha.post(CHAT, headers=USE, json=body)
                assert miss.status_code == 200, miss.text
                assert miss.headers["x-quicedge-cache"] == "miss"
                hit = await ha.post(CHAT, headers=USE, json=body)
                assert hit.headers["x-quicedge-cache"] == "hit-l1"
                assert hit.content == miss.content  # the same events (or body), replayed
                assert hit.headers["content-type"] == miss.headers["content-type"]
                far = await hb.post(CHAT, headers=USE, json=body)
                assert far.headers["x-quicedge-cache"] == "hit-l2"
                assert far.content == miss.content
                near = await hb.post(CHAT, headers=USE, json=body)
                assert near.headers["x-quicedge-cache"] == "hit-l1"
            text_a, text_b = await metrics(a), await metrics(b)
    assert count(text_a, "l1", "hit") == 1 and count(text_a, "l1", "miss") == 1
    assert count(text_a, "l2", "miss") == 1
    assert count(text_b, "l2", "hit") == 1 and count(text_b, "l1", "hit") == 1
    assert 'quicedge_cache_stores_total{outcome="stored"} 1.0' in text_a


async def test_only_allowed_tenants_deterministic_opted_in_requests_are_cached() -> None:
    upstream = ChatUpstream()
    settings = state(cache={"allow_tenants": ["alpha"]})
    async with TinyUpstream(upstream) as up:
        config = fast_config([up.url], state=settings, admission=tenants("alpha", "beta"))
        async with run_edge(config) as edge, client(edge) as http:
            alpha = {**USE, **as_tenant("alpha")}

            async def twice(headers: dict[str, str], body: dict[str, Any]) -> list[str | None]:
                out = []
                for _ in range(2):
                    response = await http.post(CHAT, headers=headers, json=body)
                    assert response.status_code == 200
                    out.append(response.headers.get("x-quicedge-cache"))
                return out

            assert await twice(alpha, GREEDY) == ["miss", "hit-l1"]
            sampled = {**GREEDY, "temperature": 0.7}
            assert await twice(alpha, sampled) == [None, None]  # not deterministic
            seeded = {**sampled, "seed": 42}
            assert await twice(alpha, seeded) == ["miss", "hit-l1"]
            other = {**USE, **as_tenant("beta")}
            assert await twice(other, GREEDY) == [None, None]  # beta did not allow it
            plain = as_tenant("alpha")
            assert await twice(plain, {**GREEDY, "max_tokens": 3}) == [None, None]  # no opt-in
            # tenants never share entries: the same request by another allowed tenant misses
    # every request that was not a hit reached the upstream
    assert len(upstream.chats) == 1 + 2 + 1 + 2 + 2


async def test_per_route_opt_in_and_opt_out() -> None:
    upstream = ChatUpstream()
    settings = state(cache={"allow_tenants": ["*"], "routes": [CHAT]})
    async with TinyUpstream(upstream) as up:
        async with run_edge(fast_config([up.url], state=settings)) as edge, client(edge) as http:
            first = await http.post(CHAT, json=GREEDY)
            second = await http.post(CHAT, json=GREEDY)
            assert (first.headers["x-quicedge-cache"], second.headers["x-quicedge-cache"]) == (
                "miss", "hit-l1")  # fmt: skip
            off = await http.post(CHAT, headers={"x-quicedge-cache": "off"}, json=GREEDY)
            assert "x-quicedge-cache" not in off.headers
    assert len(upstream.chats) == 2


async def test_a_failed_or_cut_stream_is_never_stored() -> None:
    def reply(n: int, recorded: Any) -> Reply:
        if n == 0:
            return Reply(headers=[("content-type", "text/event-stream")],
                         chunks=chat_chunks(["half", "way"]), die_after=2)  # fmt: skip
        if n == 1:
            return Reply(status=400, headers=[("content-type", "application/json")],
                         chunks=[b'{"error":{"message":"bad"}}'], chunked=False)  # fmt: skip
        if n == 2:  # ends cleanly, but before its [DONE]
            return Reply(headers=[("content-type", "text/event-stream")],
                         chunks=chat_chunks(["short"])[:-1])  # fmt: skip
        if n == 3:  # the backend's own error event
            error = b'data: {"error":{"message":"oom","code":500}}\n\ndata: [DONE]\n\n'
            return Reply(headers=[("content-type", "text/event-stream")],
                         chunks=[*chat_chunks(["part"])[:2], error])  # fmt: skip
        return Reply(headers=[("content-type", "text/event-stream")],
                     chunks=chat_chunks(["whole"]))  # fmt: skip

    upstream = ChatUpstream(reply)
    settings = state(cache={"allow_tenants": ["*"]})
    async with TinyUpstream(upstream) as up:
        async with run_edge(fast_config([up.url], state=settings)) as edge, client(edge) as http:
            body = {**GREEDY, "stream": True}
            cut = await http.post(CHAT, headers=USE, json=body)
            assert b'"error"' in cut.content
            refused = await http.post(CHAT, headers=USE, json=body)
            assert refused.status_code == 400
            short = await http.post(CHAT, headers=USE, json=body)
            assert short.status_code == 200 and b"[DONE]" not in short.content
            failed = await http.post(CHAT, headers=USE, json=body)
            assert b"oom" in failed.content
            whole = await http.post(CHAT, headers=USE, json=body)
            assert whole.headers["x-quicedge-cache"] == "miss" and b"whole" in whole.content
            hit = await http.post(CHAT, headers=USE, json=body)
            assert hit.headers["x-quicedge-cache"] == "hit-l1" and hit.content == whole.content
            text = await metrics(edge)
    assert len(upstream.chats) == 5
    assert 'quicedge_cache_stores_total{outcome="incomplete"} 3.0' in text


def generate_events(tokens: int, finish: dict[str, Any]) -> list[bytes]:
    """SGLang's /generate stream: cumulative text, `meta_info` on every event, then [DONE]."""
    out = []
    for n in range(1, tokens + 1):
        meta = {"id": "r", "finish_reason": finish if n == tokens else None,
                "completion_tokens": n}  # fmt: skip
        out.append(b"data: " + json.dumps({"text": "w" * n, "meta_info": meta}).encode() + b"\n\n")
    return [*out, b"data: [DONE]\n\n"]


async def test_an_answer_its_backend_aborted_is_not_stored() -> None:
    """SGLang ends a /generate stream it aborted (`/abort_request`, a full queue, a drain) as
    any other, `finish_reason` `{"type": "abort"}` and `[DONE]`: it is relayed, never stored,
    so the next identical request is answered again; a whole answer saying so neither."""
    abort = {"type": "abort", "message": "Abort by the client."}

    def reply(n: int, recorded: Any) -> Reply:
        stream = json.loads(recorded.body).get("stream")
        if recorded.path == "/generate" and stream:
            finish = abort if n == 0 else {"type": "length", "length": 3}
            return Reply(headers=[("content-type", "text/event-stream")],
                         chunks=generate_events(3 if n else 2, finish))  # fmt: skip
        if recorded.path == "/generate":
            body = {"text": "w", "meta_info": {"id": "r", "finish_reason": abort}}
            return Reply(headers=[("content-type", "application/json")], chunked=False,
                         chunks=[json.dumps(body).encode()])  # fmt: skip
        whole = json.loads(chat_whole("cut"))
        whole["choices"][0]["finish_reason"] = "abort"
        return Reply(headers=[("content-type", "application/json")], chunked=False,
                     chunks=[json.dumps(whole).encode()])  # fmt: skip

    upstream = ChatUpstream(reply)
    settings = state(cache={"allow_tenants": ["*"]})
    async with TinyUpstream(upstream) as up:
        async with run_edge(fast_config([up.url], state=settings)) as edge, client(edge) as http:
            body = {"text": "hi", "stream": True, "sampling_params": {"temperature": 0}}
            seen = []
            for _ in range(3):
                response = await http.post("/generate", headers=USE, json=body)
                assert response.status_code == 200
                seen.append((response.headers["x-quicedge-cache"], b'"abort"' in response.content))
            assert seen == [("miss", True), ("miss", False), ("hit-l1", False)]
            for path, whole in (("/generate", {**body, "stream": False}), (CHAT, GREEDY)):
                for _ in range(2):
                    response = await http.post(path, headers=USE, json=whole)
                    assert response.headers["x-quicedge-cache"] == "miss"
            text = await metrics(edge)
    assert len(upstream.chats) == 2 + 2 + 2
    assert 'quicedge_cache_stores_total{outcome="incomplete"} 5.0' in text


async def test_a_new_model_version_invalidates_entries(redis_url: str, redis_prefix: str) -> None:
    """Pinned versions: a second edge on v2 misses what v1 stored. Learned versions: once the
    backend reports a new `weight_version`, older entries miss."""
    upstream = ChatUpstream()
    async with TinyUpstream(upstream) as up:
        v1 = state(redis_url, redis_prefix,
                   cache={"allow_tenants": ["*"], "model_versions": ["default=v1"]})  # fmt: skip
        v2 = state(redis_url, redis_prefix,
                   cache={"allow_tenants": ["*"], "model_versions": ["default=v2"]})  # fmt: skip
        async with run_edge(fast_config([up.url], state=v1)) as a, client(a) as ha:
            assert (await ha.post(CHAT, headers=USE, json=GREEDY)).headers[
                "x-quicedge-cache"] == "miss"  # fmt: skip
        async with run_edge(fast_config([up.url], state=v2)) as b, client(b) as hb:
            assert (await hb.post(CHAT, headers=USE, json=GREEDY)).headers[
                "x-quicedge-cache"] == "miss"  # fmt: skip
        async with run_edge(fast_config([up.url], state=v1)) as c, client(c) as hc:
            assert (await hc.post(CHAT, headers=USE, json=GREEDY)).headers[
                "x-quicedge-cache"] == "hit-l2"  # fmt: skip

    version = {"now": "w1"}

    def reply(n: int, recorded: Any) -> Reply:
        return Reply(headers=[("content-type", "application/json")], chunked=False,
                     chunks=[chat_whole(f"answer {n}", weight_version=version["now"])])  # fmt: skip

    learned = ChatUpstream(reply)
    async with TinyUpstream(learned) as up:
        settings = state(cache={"allow_tenants": ["*"]})
        async with run_edge(fast_config([up.url], state=settings)) as edge, client(edge) as http:

            async def ask(text: str) -> str:
                body = {**GREEDY, "messages": [{"role": "user", "content": text}]}
                response = await http.post(CHAT, headers=USE, json=body)
                return str(response.headers["x-quicedge-cache"])

            assert [await ask("x"), await ask("x")] == ["miss", "hit-l1"]
            version["now"] = "w2"  # the backend loaded new weights
            assert await ask("y") == "miss"  # its answer reports w2
            assert await ask("x") == "miss"  # x's w1 entry no longer matches
            assert await ask("x") == "hit-l1"
    assert len(learned.chats) == 3


async def test_the_version_and_pool_routing_chose_are_part_of_the_key() -> None:
    """A gray release: the canary's answer is never replayed to a request routed to stable
    (nor the other way), each shares with its own; an alias a reload points at another pool
    misses what its old pool answered."""
    async with sims(sim("m", model_version="v1"), sim("m", model_version="v2"),
                    sim("other")) as (stable, canary, other):  # fmt: skip
        models = ModelsConfig(rollouts=[rollout()], aliases=[Alias("chat", "m")])
        settings = state(cache={"allow_tenants": ["*"]})
        config = fast_config([stable.url, canary.url, other.url], state=settings)
        async with run_edge(config, models=models) as edge, client(edge) as http:
            body = {**GREEDY, "model": "m"}

            async def ask(body: dict[str, Any], split: str | None = None) -> tuple[str, str]:
                headers = {**USE, **({"x-canary": split} if split is not None else {})}
                response = await http.post(CHAT, headers=headers, json=body)
                assert response.status_code == 200, response.text
                where = response.headers.get("x-quicedge-backend", "cache")
                return response.headers["x-quicedge-cache"], where

            assert await ask(body, "1") == ("miss", netloc(canary))
            assert await ask(body, "0") == ("miss", netloc(stable))
            assert await ask(body, "1") == ("hit-l1", "cache")
            assert await ask(body, "0") == ("hit-l1", "cache")
            aliased = {**body, "model": "chat"}
            assert await ask(aliased, "0") == ("miss", netloc(stable))
            assert await ask(aliased, "0") == ("hit-l1", "cache")
            await edge.wiring.models.reconfigure(ModelsConfig(aliases=[Alias("chat", "other")]))
            assert await ask(aliased) == ("miss", netloc(other))
            assert await ask(aliased) == ("hit-l1", "cache")


async def test_a_replayed_stream_meets_the_stream_rules_in_force_now() -> None:
    """An answer stored before a reload added a stream rule is cut by it when replayed, as a
    fresh answer is: a hit is no way around the policy."""
    leak = ["-----BEGIN PRIVATE KEY", "----- abc"]
    async with TinyUpstream(lambda r: health_ok(r) or sse_reply(leak)) as up:
        config = fast_config([up.url], state=state(cache={"allow_tenants": ["*"]}))
        async with run_edge(config) as edge, client(edge) as http:
            body = {"model": "tiny-model", "prompt": "the key?", "stream": True, "temperature": 0}
            stored = await http.post("/v1/completions", headers=USE, json=body)
            assert stored.headers["x-quicedge-cache"] == "miss"
            assert b"PRIVATE KEY" in stored.content
            rule = {"id": "key-leak", "patterns": ["BEGIN PRIVATE KEY"], "literal": True}
            policy = PolicyConfig.from_mapping({"stream_rules": [rule]})
            decisions: list[tuple[str, str]] = []
            gateway = PolicyGateway.from_config(
                policy, on_decision=lambda rule, outcome: decisions.append((rule, outcome))
            )
            await edge.wiring.swap_gateway(gateway)
            hit = await http.post("/v1/completions", headers=USE, json=body)
            assert hit.status_code == 200 and hit.headers["x-quicedge-cache"] == "hit-l1"
            assert b"PRIVATE KEY" not in hit.content
            assert b'"finish_reason":"content_filter"' in hit.content
            assert hit.content.endswith(b"data: [DONE]\n\n")
            assert ("key-leak", "filtered") in decisions  # counted as a live stream's cut is
            again = await http.post("/v1/completions", headers=USE, json={**body, "n": 1})
            assert b"PRIVATE KEY" not in again.content  # a fresh answer is cut the same way
            assert b'"finish_reason":"content_filter"' in again.content


def echo(recorded: Any) -> Reply:
    """An answer that repeats the prompt it was given."""
    found = health_ok(recorded)
    if found is not None:
        return found
    said = json.loads(recorded.body)["messages"][-1]["content"]
    return Reply(headers=[("content-type", "application/json")], chunked=False,
                 chunks=[chat_whole(said)])  # fmt: skip


async def test_the_key_is_the_body_as_request_rules_left_it() -> None:
    """A redaction a reload added changes what the backend is sent, so the answer stored for
    the unredacted prompt is not this request's: it misses, and is answered from the
    redacted one."""
    async with TinyUpstream(echo) as up:
        config = fast_config([up.url], state=state(cache={"allow_tenants": ["*"]}))
        async with run_edge(config) as edge, client(edge) as http:
            body = {**GREEDY, "messages": [{"role": "user", "content": "mail a.b@example.com"}]}

            async def ask() -> tuple[str, str]:
                response = await http.post(CHAT, headers=USE, json=body)
                assert response.status_code == 200, response.text
                said = response.json()["choices"][0]["message"]["content"]
                return response.headers["x-quicedge-cache"], said

            assert await ask() == ("miss", "mail a.b@example.com")
            rule = {"id": "email", "action": "redact", "patterns": [r"[\w.]+@[\w.]+"],
                    "replacement": "[EMAIL]"}  # fmt: skip
            policy = PolicyConfig.from_mapping({"rules": [rule]})
            await edge.wiring.swap_gateway(PolicyGateway.from_config(policy))
            assert await ask() == ("miss", "mail [EMAIL]")
            assert await ask() == ("hit-l1", "mail [EMAIL]")


async def test_an_answer_over_the_entry_limit_is_relayed_not_stored() -> None:
    def reply(n: int, recorded: Any) -> Reply:
        return Reply(headers=[("content-type", "text/event-stream")],
                     chunks=chat_chunks(["y" * 500] * 6))  # fmt: skip

    settings = state(cache={"allow_tenants": ["*"], "max_entry_bytes": 2000})
    upstream = ChatUpstream(reply)
    async with TinyUpstream(upstream) as up:
        async with run_edge(fast_config([up.url], state=settings)) as edge, client(edge) as http:
            body = {**GREEDY, "stream": True}
            first = await http.post(CHAT, headers=USE, json=body)
            second = await http.post(CHAT, headers=USE, json=body)
            assert first.content.count(b"y" * 500) == 6 and second.content == first.content
            assert second.headers["x-quicedge-cache"] == "miss"
            assert 'quicedge_cache_stores_total{outcome="too_large"} 2.0' in await metrics(edge)
    assert len(upstream.chats) == 2


async def test_l1_stays_within_its_byte_bound() -> None:
    config = CacheConfig(allow_tenants=["*"], l1_max_bytes=20_000)
    cache = ResponseCache(config, tiers=[], registry=CollectorRegistry())
    keys = [cache.key("t", CHAT, "m", json.dumps({"n": n}).encode()) for n in range(40)]
    for key in keys:
        await cache.put(key, stream=True, body=b"z" * 1500, content_type=b"text/event-stream")
        assert cache.l1.currsize <= 20_000
    assert await cache.get(keys[0]) is None  # the oldest were evicted
    found = await cache.get(keys[-1])
    assert found is not None and found[1] == "l1"
    held = sum(1 for k in keys if k in cache.l1)
    assert 5 <= held < 40
    assert cache.l1_bytes._value.get() == cache.l1.currsize  # type: ignore[attr-defined]


def test_entries_survive_their_encoding() -> None:
    entry = Entry(True, b"data: x\n\ndata: [DONE]\n\n", 1234.5, b"text/event-stream; charset=utf-8")
    assert Entry.decode(entry.encode()) == entry
    assert Entry.decode(b"garbage") is None


async def test_with_redis_down_cached_requests_go_on_uncached() -> None:
    server = RedisServer()
    try:
        settings = state(server.url, "t:", cache={"allow_tenants": ["*"]}, timeout=0.3)
        upstream = ChatUpstream()
        async with TinyUpstream(upstream) as up:
            async with run_edge(fast_config([up.url], state=settings)) as edge:
                async with client(edge) as http:
                    server.stop()
                    for _ in range(2):
                        response = await http.post(CHAT, headers=USE, json=GREEDY)
                        assert response.status_code == 200
                        # L1 still serves what this process stored, without Redis
                        assert response.headers["x-quicedge-cache"] in ("miss", "hit-l1")
                    text = await metrics(edge)
        assert count(text, "l2", "error") == 1
        assert 'quicedge_cache_stores_total{outcome="error"} 1.0' in text
        assert len(upstream.chats) == 1
    finally:
        server.stop()
