"""The check and calibration tools: the fit recovers known parameters; bad input is refused."""

from __future__ import annotations

import pytest

from backends.sim import SimServer, probe
from backends.sim.calibrate import fit, measure, parse_points
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
