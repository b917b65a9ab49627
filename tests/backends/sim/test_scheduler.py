"""Scheduler and timing model in simulated time (VirtualClock: sleeps return at once).

Times asserted here are *simulated* seconds computed by the profile, so they are exact and
independent of how loaded the machine is.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from backends.sim.clock import VirtualClock
from backends.sim.config import SimConfig
from backends.sim.profiles import get_profile
from backends.sim.request import SimRequest, State
from backends.sim.scheduler import Scheduler
from backends.sim.textgen import OutputPlan
from backends.sim.tokenizer import EOS_ID, Tokenizer

H100 = get_profile("h100-llama3-8b")
TOKENIZER = Tokenizer()


def make_req(ids: list[int], max_new: int = 4, rid: str | None = None, **kw: Any) -> SimRequest:
    plan = OutputPlan(TOKENIZER, ids, seed=0, natural_len=kw.pop("natural_len", (10_000, 10_000)))
    return SimRequest(rid=rid or f"r{id(plan)}", input_ids=ids, max_new_tokens=max_new,
                      plan=plan, **kw)  # fmt: skip


def prompt(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


class Harness:
    def __init__(self, **config: Any) -> None:
        self.clock = VirtualClock()
        self.sched = Scheduler(SimConfig(profile="h100-llama3-8b", **config), clock=self.clock)

    async def finish(self, *reqs: SimRequest) -> None:
        for req in reqs:
            while not req.finished:
                await req.wait_change()

    async def settle(self) -> None:
        """Let the scheduler loop run until it blocks (no work) or 200 yields pass."""
        for _ in range(200):
            await asyncio.sleep(0)

    def ttft(self, req: SimRequest) -> float:
        assert req.first_token_at is not None
        return req.first_token_at - req.created_at


@pytest.fixture
async def harness_factory() -> AsyncIterator[Any]:
    tasks: list[asyncio.Task[None]] = []

    def make(**config: Any) -> Harness:
        h = Harness(**config)
        tasks.append(asyncio.get_running_loop().create_task(h.sched.run()))
        return h

    yield make
    for task in tasks:
        task.cancel()


async def test_ttft_is_the_profile_prediction_and_linear_in_uncached_tokens(
    harness_factory: Any,
) -> None:
    h = harness_factory()
    ttfts = {}
    for n in (1000, 2000, 4000):
        req = make_req(prompt(n, start=n * 10))  # disjoint prompts: no cache hits
        h.sched.submit(req)
        await h.finish(req)
        assert req.cached_tokens == 0
        ttfts[n] = h.ttft(req)
        assert ttfts[n] == pytest.approx(H100.predict_ttft(n), rel=1e-9)
    # Linear term dominates: doubling the tokens roughly doubles TTFT minus the fixed part.
    slope1 = (ttfts[2000] - ttfts[1000]) / 1000
    slope2 = (ttfts[4000] - ttfts[2000]) / 2000
    assert slope1 == pytest.approx(slope2, rel=0.1)
    assert slope1 == pytest.approx(H100.a, rel=0.1)


async def test_cached_prompt_is_faster_and_reports_len_minus_one(harness_factory: Any) -> None:
    h = harness_factory()
    ids = prompt(2000)
    first = make_req(ids)
    h.sched.submit(first)
    await h.finish(first)
    again = make_req(ids)
    h.sched.submit(again)
    await h.finish(again)
    assert again.cached_tokens == 1999
    assert h.ttft(again) == pytest.approx(H100.predict_ttft(2000, 1999))
    assert h.ttft(first) / h.ttft(again) > 5
    # A follow-up that extends prompt + answer hits on the answer too.
    follow = make_req(ids + first.output_ids + prompt(10, start=50_000))
    h.sched.submit(follow)
    await h.finish(follow)
    assert follow.cached_tokens == 2000 + len(first.output_ids)


async def test_queueing_past_max_running_requests(harness_factory: Any) -> None:
    h = harness_factory(max_running_requests=2)
    reqs = [make_req(prompt(100, start=1000 * i), max_new=50) for i in range(5)]
    for r in reqs:
        h.sched.submit(r)
    while reqs[0].state is not State.RUNNING:
        await reqs[0].wait_change()
    assert h.sched.num_running == 2 and h.sched.num_waiting == 3
    await h.finish(*reqs)
    # The third request waited for a slot: its TTFT includes the first two's decoding.
    assert h.ttft(reqs[2]) > 50 * H100.d0
    assert h.ttft(reqs[0]) < 2 * H100.predict_ttft(200)


async def test_prefill_runs_before_decode(harness_factory: Any) -> None:
    h = harness_factory()
    long = make_req(prompt(100), max_new=1000)
    h.sched.submit(long)
    while long.completion_tokens < 10:
        await long.wait_change()
    newcomer = make_req(prompt(1000, start=10_000), max_new=2)
    h.sched.submit(newcomer)
    submitted_at = h.clock.now()
    tokens_before = long.completion_tokens
    while newcomer.first_token_at is None:
        await newcomer.wait_change()
    # At most the decode step already in flight finished before the prefill ran.
    assert long.completion_tokens - tokens_before <= 1
    step = H100.decode_time(1, 200)
    assert newcomer.first_token_at - submitted_at <= H100.predict_ttft(1000) + step + 1e-9
    long_abort = h.sched.abort(long)
    assert long_abort


async def test_long_prompt_is_chunked(harness_factory: Any) -> None:
    h = harness_factory(chunked_prefill_size=8192)
    req = make_req(prompt(20_000))
    h.sched.submit(req)
    await h.finish(req)
    expected = (
        H100.prefill_time([(8192, 0)])
        + H100.prefill_time([(8192, 8192)])
        + H100.prefill_time([(20_000 - 16_384, 16_384)])
    )
    assert h.ttft(req) == pytest.approx(expected)
    assert req.cached_tokens == 0


async def test_prefill_batch_respects_max_prefill_tokens(harness_factory: Any) -> None:
    h = harness_factory(max_prefill_tokens=16384, chunked_prefill_size=65536)
    a = make_req(prompt(10_000), max_new=1)
    b = make_req(prompt(10_000, start=100_000), max_new=1)
    h.sched.submit(a)
    h.sched.submit(b)
    await h.finish(a, b)
    # b does not fit in a's batch (20k > 16384 new tokens): it runs in the next one.
    assert h.ttft(a) == pytest.approx(H100.predict_ttft(10_000))
    assert h.ttft(b) == pytest.approx(2 * H100.predict_ttft(10_000))


async def test_co_batched_requests_share_one_prefill(harness_factory: Any) -> None:
    h = harness_factory()
    a = make_req(prompt(1000), max_new=1)
    b = make_req(prompt(1000, start=100_000), max_new=1)
    h.sched.submit(a)
    h.sched.submit(b)
    await h.finish(a, b)
    both = H100.prefill_time([(1000, 0), (1000, 0)])
    assert h.ttft(a) == pytest.approx(both) and h.ttft(b) == pytest.approx(both)


async def test_kv_admission_waits_for_memory_and_eviction_frees_it(harness_factory: Any) -> None:
    h = harness_factory(max_total_tokens=1000)
    a = make_req(prompt(600), max_new=100)
    b = make_req(prompt(600, start=10_000), max_new=100)
    h.sched.submit(a)
    h.sched.submit(b)
    while a.state is not State.RUNNING:
        await a.wait_change()
    assert b.state is State.WAITING  # 700 + 700 > 1000
    await h.finish(a, b)
    # b evicted a's cached prompt+answer to fit.
    assert h.sched.cache.total_size <= 1000
    assert h.sched.cache.match_prefix(prompt(600))[0] == 0
    assert h.sched.cache.match_prefix(prompt(600, start=10_000))[0] == 600


async def test_in_flight_prefix_is_locked_against_eviction(harness_factory: Any) -> None:
    h = harness_factory(max_total_tokens=1000)
    old = make_req(prompt(299, start=50_000), max_new=1)  # leaves 300 unlocked tokens cached
    h.sched.submit(old)
    await h.finish(old)
    a = make_req(prompt(400), max_new=100)
    h.sched.submit(a)
    while a.state is not State.RUNNING:
        await a.wait_change()
    # free = 1000 - 300 (old) - 400 (a, locked) - 100 (a's reserve) = 200 < 250 needed
    b = make_req(prompt(200, start=10_000), max_new=50)
    h.sched.submit(b)
    await h.finish(b)
    assert not a.finished
    assert h.sched.cache.match_prefix(prompt(400))[0] == 400  # locked: kept
    assert h.sched.cache.match_prefix(prompt(299, start=50_000))[0] == 0  # unlocked: evicted
    h.sched.abort(a)


async def test_concurrent_requests_share_a_prefilled_prompt(harness_factory: Any) -> None:
    h = harness_factory()
    system = prompt(2000)
    a = make_req(system + [90_001], max_new=50)
    h.sched.submit(a)
    while a.first_token_at is None:
        await a.wait_change()
    b = make_req(system + [90_002], max_new=2)  # arrives while a is still decoding
    h.sched.submit(b)
    await h.finish(b)
    assert b.cached_tokens == 2000
    h.sched.abort(a)


async def test_paged_cache_reports_page_multiples(harness_factory: Any) -> None:
    h = harness_factory(page_size=16)
    ids = prompt(100)
    a = make_req(ids, max_new=3)
    h.sched.submit(a)
    await h.finish(a)
    b = make_req(ids, max_new=1)
    h.sched.submit(b)
    await h.finish(b)
    assert b.cached_tokens == 96  # min(99, 103 cached) rounded down to pages of 16


async def test_abort_frees_the_slot(harness_factory: Any) -> None:
    h = harness_factory(max_running_requests=1)
    a = make_req(prompt(10), max_new=10_000)
    b = make_req(prompt(10, start=100), max_new=2)
    h.sched.submit(a)
    h.sched.submit(b)
    while a.state is not State.RUNNING:
        await a.wait_change()
    assert b.state is State.WAITING
    assert h.sched.abort(a)
    assert a.finish_reason is not None and a.finish_reason["type"] == "abort"
    await h.finish(b)
    assert b.finish_reason == {"type": "length", "length": 2}
    assert h.sched.idle and h.sched.cache.protected_size == 0
    assert not h.sched.abort(a)  # already finished


async def test_finish_conditions(harness_factory: Any) -> None:
    h = harness_factory()
    natural = make_req(prompt(10), max_new=100, natural_len=(5, 5))
    h.sched.submit(natural)
    await h.finish(natural)
    assert natural.finish_reason == {"type": "stop", "matched": EOS_ID}
    assert natural.completion_tokens == 5 and natural.output_ids[-1] == EOS_ID

    ignore = make_req(prompt(10), max_new=8, natural_len=(5, 5), ignore_eos=True)
    h.sched.submit(ignore)
    await h.finish(ignore)
    assert ignore.finish_reason == {"type": "length", "length": 8}
    assert EOS_ID not in ignore.output_ids

    min_new = make_req(prompt(10), max_new=9, natural_len=(2, 2), min_new_tokens=6)
    h.sched.submit(min_new)
    await h.finish(min_new)
    assert min_new.completion_tokens >= 6

    probe = make_req(prompt(20), max_new=6, ignore_eos=True)
    h.sched.submit(probe)
    await h.finish(probe)
    third = probe.output_ids[2]
    by_id = make_req(prompt(20), max_new=6, ignore_eos=True, stop_token_ids=frozenset({third}))
    h.sched.submit(by_id)
    await h.finish(by_id)
    assert by_id.finish_reason == {"type": "stop", "matched": third}
    assert by_id.completion_tokens == 3

    word = probe.pieces[3].strip()
    by_str = make_req(prompt(20), max_new=6, ignore_eos=True, stop=(word,))
    h.sched.submit(by_str)
    await h.finish(by_str)
    assert by_str.finish_reason == {"type": "stop", "matched": word}
    assert word not in by_str.text() or probe.text().index(word) < len(by_str.text())
    assert by_str.text() == probe.text()[: probe.text().index(word)]

    prefill_only = make_req(prompt(30), max_new=0)
    h.sched.submit(prefill_only)
    await h.finish(prefill_only)
    assert prefill_only.finish_reason == {"type": "length", "length": 0}
    assert prefill_only.completion_tokens == 0


async def test_flush_cache_refused_while_busy(harness_factory: Any) -> None:
    h = harness_factory()
    a = make_req(prompt(10), max_new=10_000)
    h.sched.submit(a)
    while a.state is not State.RUNNING:
        await a.wait_change()
    assert not h.sched.flush_cache()
    h.sched.abort(a)
    assert h.sched.flush_cache()
    assert h.sched.cache.total_size == 0


async def test_duplicate_rid_is_refused(harness_factory: Any) -> None:
    h = harness_factory()
    h.sched.submit(make_req(prompt(10), max_new=10_000, rid="x"))
    with pytest.raises(ValueError, match="duplicate"):
        h.sched.submit(make_req(prompt(10), rid="x"))
    h.sched.abort_all()
