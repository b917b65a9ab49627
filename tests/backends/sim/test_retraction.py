"""The stand-in's KV pool under pressure: running requests that outgrow it are retracted and
re-queued (SGLang's `retract_decode`), every one still completes with all its tokens, and the
retractions show in `/v1/loads`, `/metrics` and each answer's `total_retractions`; what can never
fit is refused."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from backends.sim.config import SimConfig
from tests.backends.sim.conftest import MakeSim
from tests.backends.sim.test_scheduler import harness_factory, make_req, prompt

__all__ = ["harness_factory"]  # the fixture, shared with the scheduler tests


async def test_outgrowing_the_pool_retracts_and_requeues(harness_factory: Any) -> None:
    # 4 requests of 100 prompt + 200 output tokens in a 1,000-token pool: with a tenth of the
    # output reserved, all four are admitted (4 x 120), and at ~250 tokens each they collide
    h = harness_factory(max_total_tokens=1000, new_token_ratio=0.1, disable_radix_cache=True)
    reqs = [make_req(prompt(100, start=i * 1000), max_new=200, ignore_eos=True) for i in range(4)]
    for req in reqs:
        h.sched.submit(req)
    await h.finish(*reqs)
    assert [r.completion_tokens for r in reqs] == [200] * 4
    assert all(r.finish_reason == {"type": "length", "length": 200} for r in reqs)
    assert h.sched.stats.num_retracted_reqs_total >= 1
    assert sum(r.retractions for r in reqs) == h.sched.stats.num_retracted_reqs_total
    assert h.sched.used_tokens <= 1000 and not h.sched.holding


async def test_full_reservation_never_retracts(harness_factory: Any) -> None:
    h = harness_factory(max_total_tokens=1000, disable_radix_cache=True)
    reqs = [make_req(prompt(100, start=i * 1000), max_new=200, ignore_eos=True) for i in range(4)]
    for req in reqs:
        h.sched.submit(req)
    await h.finish(*reqs)
    assert [r.completion_tokens for r in reqs] == [200] * 4
    assert h.sched.stats.num_retracted_reqs_total == 0


async def test_a_request_that_outgrows_the_whole_pool_alone_is_aborted(
    harness_factory: Any,
) -> None:
    h = harness_factory(max_total_tokens=300, new_token_ratio=0.1, disable_radix_cache=True)
    req = make_req(prompt(100), max_new=250, ignore_eos=True)
    h.sched.submit(req)
    await h.finish(req)
    assert req.finish_reason is not None and req.finish_reason["type"] == "abort"
    assert "does not fit" in str(req.finish_reason["message"])
    assert req.completion_tokens == 200  # it ran until the pool was full


def test_new_token_ratio_is_checked() -> None:
    with pytest.raises(ValueError, match="new_token_ratio"):
        SimConfig(new_token_ratio=0.0)


async def test_retractions_show_in_loads_metrics_and_meta_info(
    make_sim: MakeSim, client: httpx.AsyncClient
) -> None:
    sim = await make_sim(
        max_total_tokens=600, new_token_ratio=0.1, enable_metrics=True, disable_radix_cache=True
    )

    async def generate(i: int) -> dict[str, Any]:
        body = {
            "text": f"request number {i} " * 8,
            "sampling_params": {"max_new_tokens": 120, "ignore_eos": True},
        }
        r = await client.post(sim.url + "/generate", json=body)
        assert r.status_code == 200
        return dict(r.json())

    answers = await asyncio.gather(*(generate(i) for i in range(6)))
    assert all(a["meta_info"]["completion_tokens"] == 120 for a in answers)
    retractions = sum(a["meta_info"]["total_retractions"] for a in answers)
    assert retractions >= 1
    loads = (await client.get(sim.url + "/v1/loads")).json()["loads"][0]
    assert loads["num_retracted_reqs"] == retractions
    metrics = (await client.get(sim.url + "/metrics")).text
    line = next(x for x in metrics.splitlines() if x.startswith("sglang:num_retracted_reqs"))
    assert float(line.split()[-1]) == retractions


async def test_a_prompt_that_can_never_fit_is_refused(
    make_sim: MakeSim, client: httpx.AsyncClient
) -> None:
    sim = await make_sim(max_total_tokens=64)
    r = await client.post(sim.url + "/generate", json={"text": "word " * 200})
    assert r.status_code == 400
    assert "does not fit in the KV cache" in r.json()["error"]["message"]
