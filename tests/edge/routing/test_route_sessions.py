"""Sticky sessions in the `ttft` policy: what the session map keeps, and for how long."""

from __future__ import annotations

import gc
import tracemalloc

from backends.registry import Backend
from edge.routing import RequestView
from edge.routing.ttft import TTFTPolicy


def fleet(n: int = 2) -> list[Backend]:
    return [Backend(name=f"b{i}", url=f"http://127.0.0.1:{9100 + i}") for i in range(n)]


def view(text: str, session: str) -> RequestView:
    return RequestView(
        route="/v1/completions", text=text, approx_tokens=len(text) // 4, session_key=session
    )


def test_the_session_map_does_not_keep_long_session_keys_alive() -> None:
    """A body's `prompt_cache_key` (or `user`) can be megabytes long: the map remembers up to
    `max_sessions` sessions, and must not hold each one's key whole (65,536 keys of 8 MiB)."""
    backends = fleet()
    policy = TTFTPolicy()
    size = 1 << 20
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(32):
            key = f"{i:08d}" + "k" * size  # a fresh 1 MiB key, dropped after the request
            policy.choose(view(f"prompt {i} " * 8, key), backends)
            del key
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert kept < 2 * size, f"{kept} bytes kept for 32 sessions"


def test_a_long_session_key_still_sticks_to_its_backend() -> None:
    backends = fleet()
    policy = TTFTPolicy()
    key = "s" * 100_000
    home = policy.choose(view("hello there " * 10, key), backends).backend
    for i in range(5):  # an idle fleet with nothing cached: only the session decides
        decision = policy.choose(view(f"new {i} " * 10, "s" * 100_000), backends)
        assert decision.backend is home


def test_the_session_rule_compares_what_the_choice_compares() -> None:
    """docs/routing.md, "`ttft`": the session's backend wins if its score (the prediction with
    the miss charge the choice adds) is within the slack of the best one's."""
    b0, b1 = fleet()
    policy = TTFTPolicy()
    prefix = "shared context " * 530  # ~8k characters, ~2k tokens
    policy.tree.insert(prefix, b1.url)
    policy._sessions["s"] = b0.url  # the session was on b0, which holds none of it
    b1.in_flight = b1.in_prefill = 1
    b1.in_flight_prefill_tokens = 1850  # b1's queue nearly costs the prefill it saves
    request = RequestView(route="/v1/completions", text=prefix + "question " * 44,
                          approx_tokens=2100, session_key="s")  # fmt: skip
    preds = {}
    for b in (b0, b1):
        cached = policy.tree.match(request.text).chars.get(b.url, 0) * 2100 // len(request.text)
        preds[b.name] = policy.model.predict(policy.features(b, min(cached, 2099), request))
    # within 10 % + 2 ms by prediction, not by score: the score decides
    assert preds["b0"] <= preds["b1"] * 1.1 + 0.002
    decision = policy.choose(request, [b0, b1])
    assert decision.backend is b1 and decision.reason == "ttft"
