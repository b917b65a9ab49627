"""What a shadow pair compares, end to end: scripted stable and canary backends behind the edge
answer with tool calls, whose names and arguments are the answer as much as its text is."""

from __future__ import annotations

import asyncio
import json
import logging
import random
from typing import Any

import pytest

from edge.models import ModelsConfig
from edge.models.config import BackendModel, DriftConfig
from tests.edge.conftest import (
    Recorded,
    Reply,
    TinyUpstream,
    client,
    fast_config,
    health_ok,
    run_edge,
)
from tests.edge.models.test_pools_e2e import chat, sim, sims
from tests.edge.models.test_rollout_e2e import rollout
from tests.helpers import wait_until

TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip


def _json(obj: Any) -> Reply:
    return Reply(chunks=[json.dumps(obj).encode()], chunked=False,
                 headers=[("content-type", "application/json")])  # fmt: skip


def tool_answer(city: str, *, stream: bool) -> Reply:
    """A chat answer that calls `weather` for `city` (SGLang's shapes, streamed or whole)."""
    arguments = json.dumps({"city": city})
    if not stream:
        call = {"id": "call_1", "type": "function",
                "function": {"name": "weather", "arguments": arguments}}  # fmt: skip
        return _json({"choices": [{"index": 0, "message": {"role": "assistant", "content": None,
                                                           "tool_calls": [call]},
                                   "logprobs": None, "finish_reason": "tool_calls"}],
                      "usage": {"completion_tokens": 8}})  # fmt: skip
    deltas = [
        {"role": "assistant", "content": None, "tool_calls": [{"index": 0, "id": "call_1",
         "type": "function", "function": {"name": "weather", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": arguments[:5]}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": arguments[5:]}}]},
    ]  # fmt: skip
    events = [{"choices": [{"index": 0, "delta": d, "logprobs": None, "finish_reason": None}]}
              for d in deltas]  # fmt: skip
    events.append({"choices": [{"index": 0, "delta": {}, "logprobs": None,
                                "finish_reason": "tool_calls"}]})  # fmt: skip
    chunks = [b"data: " + json.dumps(e).encode() + b"\n\n" for e in events]
    return Reply(headers=[("content-type", "text/event-stream")],
                 chunks=[*chunks, b"data: [DONE]\n\n"])  # fmt: skip


def calling(city: str) -> Any:
    def script(recorded: Recorded) -> Reply:
        known = health_ok(recorded)
        if known is not None:
            return known
        return tool_answer(city, stream=json.loads(recorded.body).get("stream", False))

    return script


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("city", ["Rome", "Paris"])
async def test_tool_calls_are_compared_by_name_and_arguments(stream: bool, city: str) -> None:
    async with TinyUpstream(calling("Paris")) as stable, TinyUpstream(calling(city)) as canary:
        models = ModelsConfig(
            backends=[BackendModel(stable.url, model="m", version="v1"),
                      BackendModel(canary.url, model="m", version="v2")],
            rollouts=[rollout(steps=[1e-6], shadow_fraction=1.0, shadow_rate=1000)],
        )  # fmt: skip
        body = {"model": "m", "temperature": 0, "stream": stream, "tools": TOOLS,
                "messages": [{"role": "user", "content": "weather?"}]}  # fmt: skip
        async with (
            run_edge(fast_config([stable.url, canary.url]), models=models) as edge,
            client(edge) as http,
        ):
            shadow = edge.wiring.models.shadows["m"]
            r = await http.post("/v1/chat/completions", json=body, headers={"x-canary": "0"})
            assert r.status_code == 200 and "Paris" in r.text
            await wait_until(lambda: shadow.compared == 1, timeout=20)
            assert shadow.last is not None
            assert shadow.last.finish_agree is True
            if city == "Paris":
                assert shadow.last.exact is True and shadow.last.edit_similarity == 1
            else:
                assert shadow.last.exact is False  # Paris is not Rome
                assert shadow.last.token_overlap < 1 and shadow.last.edit_similarity < 1


async def test_a_canary_without_logprobs_does_not_grow_the_stables_windows() -> None:
    """The canary answers without the logprobs asked (another server build): its top-1 and
    entropy windows stay empty, and the stable version's hold no more than one window's worth
    instead of one sample per pair for as long as the rollout runs."""

    def plain(recorded: Recorded) -> Reply:
        known = health_ok(recorded)
        if known is not None:
            return known
        return _json({"choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                                   "finish_reason": "stop"}],
                      "usage": {"completion_tokens": 1}})  # fmt: skip

    async with sims(sim("m", model_version="v1")) as (s1,), TinyUpstream(plain) as canary:
        models = ModelsConfig(
            backends=[BackendModel(canary.url, model="m", version="v2")],
            rollouts=[rollout(steps=[1e-6], shadow_fraction=1.0, shadow_rate=1000,
                              drift=DriftConfig(window=30))],
        )  # fmt: skip
        async with (
            run_edge(fast_config([s1.url, canary.url]), models=models) as edge,
            client(edge) as http,
        ):
            shadow = edge.wiring.models.shadows["m"]
            for i in range(45):
                r = await http.post("/v1/chat/completions", json=chat("m"),
                                    headers={"x-canary": "0"})  # fmt: skip
                assert r.status_code == 200
                await wait_until(lambda i=i: shadow.compared == i + 1, timeout=20)
            windows = edge.wiring.models.ramps["m"].drift._windows
            assert len(windows[("top1", False)]) == 30 and ("top1", True) not in windows
            assert len(windows[("entropy", False)]) == 30
            assert len(windows[("length", False)]) == 15  # 45 - a window tested


def _long_text(*, every: int) -> str:
    """2,000 words drawn as a language's are (a few common, many rare; seeded), every
    `every`-th one changed: a long answer."""
    vocabulary = [f"w{i}" for i in range(3000)]
    words = random.Random(3).choices(vocabulary, [1 / (i + 1) for i in range(3000)], k=2000)
    return " ".join("other" if every and i % every == 0 else w for i, w in enumerate(words))


async def test_comparing_long_answers_does_not_hold_up_the_event_loop(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The edit similarity of two 2,000-word answers takes a CPU for a tenth of a second or
    more: run on the event loop, it would stall every client's stream on this process for
    that long, once per pair. asyncio's debug mode reports a step of the mirror's task that
    held the loop longer than `slow_callback_duration`."""

    def answering(text: str) -> Any:
        def script(recorded: Recorded) -> Reply:
            known = health_ok(recorded)
            if known is not None:
                return known
            return _json({"choices": [{"index": 0, "message": {"role": "assistant",
                                                               "content": text},
                                       "finish_reason": "stop"}],
                          "usage": {"completion_tokens": 2000}})  # fmt: skip

        return script

    stable_text, canary_text = _long_text(every=0), _long_text(every=50)
    async with (
        TinyUpstream(answering(stable_text)) as stable,
        TinyUpstream(answering(canary_text)) as canary,
    ):
        models = ModelsConfig(
            backends=[BackendModel(stable.url, model="m", version="v1"),
                      BackendModel(canary.url, model="m", version="v2")],
            rollouts=[rollout(steps=[1e-6], shadow_fraction=1.0, shadow_rate=1000)],
        )  # fmt: skip
        async with (
            run_edge(fast_config([stable.url, canary.url]), models=models) as edge,
            client(edge) as http,
        ):
            shadow = edge.wiring.models.shadows["m"]
            loop = asyncio.get_running_loop()
            loop.set_debug(True)
            loop.slow_callback_duration = 0.05
            caplog.set_level(logging.WARNING, logger="asyncio")
            try:
                r = await http.post("/v1/chat/completions", json=chat("m"),
                                    headers={"x-canary": "0"})  # fmt: skip
                assert r.status_code == 200
                await wait_until(lambda: shadow.compared == 1, timeout=30)
            finally:
                loop.set_debug(False)
            assert shadow.last is not None and 0.9 < shadow.last.edit_similarity < 1
            held = [m for m in caplog.messages if "_mirror" in m and " took " in m]
            assert not held, held


async def test_an_empty_stable_answer_gives_no_length_ratio_rather_than_zero() -> None:
    """Stable stops at once (no tokens), the canary answers: canary / stable tokens has no
    value. Read as 0 it would say the canary's answer was the empty one."""

    def answering(content: str, tokens: int) -> Any:
        def script(recorded: Recorded) -> Reply:
            known = health_ok(recorded)
            if known is not None:
                return known
            return _json({"choices": [{"index": 0, "message": {"role": "assistant",
                                                               "content": content},
                                       "finish_reason": "stop"}],
                          "usage": {"completion_tokens": tokens}})  # fmt: skip

        return script

    async with (
        TinyUpstream(answering("", 0)) as stable,
        TinyUpstream(answering("a real answer", 3)) as canary,
    ):
        models = ModelsConfig(
            backends=[BackendModel(stable.url, model="m", version="v1"),
                      BackendModel(canary.url, model="m", version="v2")],
            rollouts=[rollout(steps=[1e-6], shadow_fraction=1.0, shadow_rate=1000)],
        )  # fmt: skip
        async with (
            run_edge(fast_config([stable.url, canary.url]), models=models) as edge,
            client(edge) as http,
        ):
            shadow = edge.wiring.models.shadows["m"]
            r = await http.post("/v1/chat/completions", json=chat("m"),
                                headers={"x-canary": "0"})  # fmt: skip
            assert r.status_code == 200
            await wait_until(lambda: shadow.compared == 1, timeout=20)
            assert shadow.last is not None and shadow.last.length_ratio is None
            ratio = edge.registry.get_sample_value(
                "quicedge_shadow_similarity_count", {"model": "m", "measure": "length_ratio"}
            )
            assert not ratio, ratio
