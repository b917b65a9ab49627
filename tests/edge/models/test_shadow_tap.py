"""A shadow pair's stable half is the reply the client got: the stable version is asked once,
the sampled request asks it for logprobs the client does not see, and the canary's answer is
compared with what the tap read. Real stand-ins behind the edge, on hypercorn and on our own
HTTP/1.1 listener (where the relay writes from the upstream read callback)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from backends.sim import SimServer
from edge.models import ModelsConfig
from edge.models.tap import ShadowTap
from edge.stages.validate import CHAT, GENERATE
from tests.edge.conftest import client, fast_config, run_edge
from tests.edge.models.test_pools_e2e import sim, sims
from tests.edge.models.test_rollout_e2e import rollout
from tests.helpers import wait_until


def requests_to(server: SimServer) -> int:
    assert server.scheduler is not None
    return server.scheduler.stats.num_requests_total


def shadowed(fraction: float) -> ModelsConfig:
    return ModelsConfig(rollouts=[rollout(steps=[1e-6], shadow_fraction=fraction,
                                          shadow_rate=1000, shadow_concurrency=1)])  # fmt: skip


def events(text: str) -> list[dict[str, Any]]:
    out = []
    for line in text.split("\n"):
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


def streamed_text(text: str) -> str:
    return "".join(
        (c.get("delta") or {}).get("content") or "" for e in events(text) for c in e["choices"]
    )


def question(i: int, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 12, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": f"question {i}"}], **extra}  # fmt: skip


@pytest.mark.parametrize("listener", ["hypercorn", "h1"])
async def test_a_streamed_stable_reply_is_the_pairs_stable_half(listener: str) -> None:
    async with sims(sim("m", model_version="v1"), sim("m", model_version="v2")) as (s1, s2):
        config = fast_config([s1.url, s2.url])
        async with (
            run_edge(config, models=shadowed(1.0), listener=listener) as edge,
            client(edge) as http,
        ):
            shadow = edge.wiring.models.shadows["m"]
            texts = []
            for i in range(5):
                r = await http.post("/v1/chat/completions", json=question(i),
                                    headers={"x-canary": "0"})  # fmt: skip
                assert r.status_code == 200
                # the logprobs the edge asked for do not reach the client
                assert all(c["logprobs"] is None for e in events(r.text) for c in e["choices"])
                assert r.text.rstrip().endswith("data: [DONE]")
                texts.append(streamed_text(r.text))
                await wait_until(lambda i=i: shadow.compared == i + 1, timeout=20)
                assert shadow.last is not None
                assert shadow.last.exact is True and shadow.last.length_ratio == 1.0
                assert shadow.last.top1_agreement == 1.0  # per-token logprobs read from both
                assert shadow.last.stable_top1 == shadow.last.canary_top1
            assert requests_to(s1) == 5  # the stable version was asked once per request
            assert requests_to(s2) == 5  # and the canary once per mirror
            # the client got the same text as a request the edge did not touch
            async with httpx.AsyncClient(base_url=s1.url) as direct:
                r = await direct.post("/v1/chat/completions", json=question(4))
            assert streamed_text(r.text) == texts[4]


async def test_logprobs_the_client_asked_for_reach_it_and_are_what_the_pair_reads() -> None:
    async with sims(sim("m", model_version="v1"), sim("m", model_version="v2")) as (s1, s2):
        async with (
            run_edge(fast_config([s1.url, s2.url]), models=shadowed(1.0)) as edge,
            client(edge) as http,
        ):
            shadow = edge.wiring.models.shadows["m"]
            body = question(1, logprobs=True, top_logprobs=2)
            r = await http.post("/v1/chat/completions", json=body, headers={"x-canary": "0"})
            assert r.status_code == 200
            entries = [x for e in events(r.text) for c in e["choices"]
                       for x in (c["logprobs"] or {}).get("content") or []]  # fmt: skip
            assert entries and all(len(x["top_logprobs"]) == 2 for x in entries)
            await wait_until(lambda: shadow.compared == 1, timeout=20)
            assert shadow.last is not None and shadow.last.top1_agreement == 1.0
            assert requests_to(s1) == 1


async def test_a_non_streamed_reply_is_read_whole_and_returned_without_the_edges_logprobs() -> None:
    async with sims(sim("m", model_version="v1"), sim("m", model_version="v2")) as (s1, s2):
        async with (
            run_edge(fast_config([s1.url, s2.url]), models=shadowed(1.0)) as edge,
            client(edge) as http,
        ):
            shadow = edge.wiring.models.shadows["m"]
            r = await http.post("/v1/chat/completions", json=question(2, stream=False),
                                headers={"x-canary": "0"})  # fmt: skip
            assert r.status_code == 200 and r.json()["choices"][0]["logprobs"] is None
            assert r.json()["choices"][0]["message"]["content"]
            await wait_until(lambda: shadow.compared == 1, timeout=20)
            assert shadow.last is not None and shadow.last.exact is True
            assert shadow.last.top1_agreement == 1.0
            assert requests_to(s1) == 1


async def test_a_streamed_generate_pairs_texts_without_logprobs() -> None:
    async with sims(sim("m", model_version="v1"), sim("m", model_version="v2")) as (s1, s2):
        async with (
            run_edge(fast_config([s1.url, s2.url]), models=shadowed(1.0)) as edge,
            client(edge) as http,
        ):
            shadow = edge.wiring.models.shadows["m"]
            body = {"text": "question 3", "stream": True,
                    "sampling_params": {"max_new_tokens": 12, "temperature": 0}}  # fmt: skip
            r = await http.post("/generate", json=body, headers={"x-canary": "0"})
            assert r.status_code == 200 and "output_top_logprobs" not in r.text
            await wait_until(lambda: shadow.compared == 1, timeout=20)
            assert shadow.last is not None and shadow.last.exact is True
            assert shadow.last.length_ratio == 1.0 and shadow.last.stable_top1 is None
            assert requests_to(s1) == 1


async def test_requests_not_sampled_are_forwarded_untouched_and_carry_no_tap() -> None:
    async with sims(sim("m", model_version="v1"), sim("m", model_version="v2")) as (s1, s2):
        async with (
            run_edge(fast_config([s1.url, s2.url]), models=shadowed(0.0)) as edge,
            client(edge) as http,
        ):
            pools = edge.wiring.models
            for i in range(4):
                r = await http.post("/v1/chat/completions", json=question(i),
                                    headers={"x-canary": "0"})  # fmt: skip
                assert r.status_code == 200
            assert requests_to(s1) == 4 and requests_to(s2) == 0
            assert pools.shadows["m"].compared == 0 and not pools.shadows["m"]._tasks


def test_the_tap_reads_a_stream_cut_anywhere_and_strips_only_what_it_added() -> None:
    """The same stream fed whole and a byte at a time gives the same answer and the same bytes."""
    lp = {"content": [{"token": "Hi", "logprob": -0.1, "top_logprobs": [
        {"token": "Hi", "logprob": -0.1}, {"token": "Ho", "logprob": -2.5}]}]}  # fmt: skip
    chunks = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                      "logprobs": None, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {"content": "Hi"}, "logprobs": lp,
                      "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}]},
    ]  # fmt: skip
    stream = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks)
    stream += b"data: [DONE]\n\n"
    outs = []
    for cut in (len(stream), 1):
        tap = ShadowTap(CHAT, strip=True)
        out = b"".join(tap.feed(stream[i : i + cut]) for i in range(0, len(stream), cut))
        out += tap.finish()
        answer = tap.answer()
        assert answer is not None and answer.text == "Hi" and answer.finish == "stop"
        assert answer.top1 == ["Hi"] and answer.tokens == 1
        assert all(c["logprobs"] is None for e in events(out.decode()) for c in e["choices"])
        assert out.endswith(b"data: [DONE]\n\n")
        outs.append(out)
    assert outs[0] == outs[1]
    kept = ShadowTap(CHAT, strip=False)  # the client's own logprobs: relayed byte for byte
    assert kept.feed(stream[:10]) + kept.feed(stream[10:]) + kept.finish() == stream
    assert kept.answer() is not None


def test_an_error_event_or_an_unfinished_stream_gives_no_pair() -> None:
    tap = ShadowTap(GENERATE, strip=False)
    tap.feed(b'data: {"error": {"message": "boom"}}\n\ndata: [DONE]\n\n')
    assert tap.answer() is None
    tap = ShadowTap(CHAT, strip=False)
    tap.feed(b'data: {"choices": [{"index": 0, "delta": {"content": "Hi"}')
    tap.finish()
    assert tap.answer() is None


async def test_a_streamed_generate_with_the_clients_logprobs_is_read_once_not_per_event(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A client of `/generate` that streams and asks for its own top logprobs gets them
    cumulatively, all positions so far in every event. The tap reads them once, at the end:
    read on every event it would build n²/2 positions for n tokens (1,000 tokens: half a
    million, seconds of the event loop, in the client's relay)."""
    import edge.models.tap as tap_module

    built: list[int] = []
    real = tap_module.generate_positions

    def counting(meta: dict[str, Any]) -> Any:
        positions = real(meta)
        built.append(len(positions))
        return positions

    monkeypatch.setattr(tap_module, "generate_positions", counting)
    async with sims(sim("m", model_version="v1"), sim("m", model_version="v2")) as (s1, s2):
        async with (
            run_edge(fast_config([s1.url, s2.url]), models=shadowed(1.0)) as edge,
            client(edge) as http,
        ):
            shadow = edge.wiring.models.shadows["m"]
            body = {"text": "question 5", "stream": True, "return_logprob": True,
                    "top_logprobs_num": 3,
                    "sampling_params": {"max_new_tokens": 200, "temperature": 0,
                                        "ignore_eos": True}}  # fmt: skip
            r = await http.post("/generate", json=body, headers={"x-canary": "0"})
            assert r.status_code == 200 and "output_top_logprobs" in r.text
            await wait_until(lambda: shadow.compared == 1, timeout=20)
            assert shadow.last is not None and shadow.last.top1_agreement == 1.0
            assert sum(built) <= 2 * 200, (len(built), sum(built))


def test_a_streamed_generates_logprobs_that_cannot_be_read_give_no_pair() -> None:
    tap = ShadowTap(GENERATE, strip=False)
    event = {"text": "Hi", "meta_info": {"output_top_logprobs": [[["not", "a", "number"]]],
                                         "finish_reason": {"type": "stop"}}}  # fmt: skip
    tap.feed(b"data: " + json.dumps(event).encode() + b"\n\ndata: [DONE]\n\n")
    tap.finish()
    assert tap.answer() is None
