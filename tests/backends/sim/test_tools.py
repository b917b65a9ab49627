"""The check and calibration tools: the fit recovers known parameters; bad input is refused."""

from __future__ import annotations

import json

import pytest

from backends.sim import SimServer, probe
from backends.sim.calibrate import fit, measure, parse_points, samples_from_bench_serving
from backends.sim.selfcheck import check_queue
from tests.backends.sim.conftest import MakeSim


def test_fit_recovers_the_model_exactly() -> None:
    a, b, c = 30e-6, 9e-3, 1.3e-9
    points = [(128, 0), (512, 0), (2048, 0), (8192, 0), (128, 2048), (512, 8192)]
    samples = [(u, cc, b + a * u + c * u * (cc + u / 2)) for u, cc in points]
    fa, fb, fc = fit(samples)
    assert fa == pytest.approx(a, rel=1e-6)
    assert fb == pytest.approx(b, rel=1e-6)
    assert fc == pytest.approx(c, rel=1e-6)


def test_fit_needs_varied_points() -> None:
    with pytest.raises(ValueError, match="vary"):
        fit([(128, 0, 0.01), (128, 0, 0.011)])


def test_parse_points() -> None:
    assert parse_points("128:0, 512:2048") == [(128, 0), (512, 2048)]
    for bad in ("128", "0:5", "a:b", "12:-1"):
        with pytest.raises(ValueError, match="bad point"):
            parse_points(bad)


async def test_measure_reports_the_cached_prefix(make_sim: MakeSim) -> None:
    server = await make_sim(profile="instant")
    results = await measure(server.url, [(16, 0), (16, 64)], repeat=2, seed=3)
    assert [(u, c, cached) for u, c, _, cached in results] == [(16, 0, 0), (16, 64, 64)]
    assert all(t > 0 for _, _, t, _ in results)


async def test_queue_check_sees_16_running_24_queued(make_sim: MakeSim) -> None:
    server: SimServer = await make_sim(
        profile="h100-llama3-8b", max_running_requests=16, enable_metrics=True
    )
    lines: list[str] = []
    assert await check_queue(server.url, lines)
    assert "running=16 queued=24" in lines[-1]
    load = (await probe.get_json(server.url, "/v1/loads"))["loads"][0]
    assert load["num_running_reqs"] == 0  # the check aborts what it started


def test_fit_from_bench_serving_lines() -> None:
    a, b, c = 30e-6, 9e-3, 1.3e-9
    sys_len, question = 2048, 128

    def ttft(u: int, cc: int) -> float:
        return b + a * u + c * u * (cc + u / 2)

    def run(sys_len: int, question: int) -> str:
        lens = [sys_len + question] * 4
        ttfts = [ttft(lens[0], 0)] + [ttft(question, sys_len)] * 3
        return json.dumps({"input_lens": lens, "ttfts": ttfts})

    lines = [run(sys_len, question), run(sys_len, 512), run(sys_len, 1024)]
    samples = samples_from_bench_serving(lines, prompts_per_group=4, system_prompt_len=sys_len)
    assert fit(samples) == pytest.approx((a, b, c), rel=1e-6)
    with pytest.raises(ValueError, match="line 1"):
        samples_from_bench_serving(["{}"], prompts_per_group=4, system_prompt_len=sys_len)
