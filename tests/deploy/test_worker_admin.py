"""A rollout action taken on the shared admin listener of `quicedge serve --workers 2` moves the
rollout of both workers, not only of the one that took the request; so does a rollback or an
advance that one worker's ramp decides."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from tests.deploy.processes import sim_process, wait_ready
from tests.deploy.test_fleet_metrics import samples
from tests.helpers import free_port
from tests.transport.conftest import ServeProcess

ROLLOUT = """
[[models.rollouts]]
model = "m"
stable = "v1"
canary = "v2"
steps = [50.0]
auto = false
"""


def canary_percent(admin: str) -> dict[str, float]:
    fleet = httpx.get(f"{admin}/metrics", timeout=10).text
    return {
        labels["worker"]: value
        for labels, value in samples(fleet, "quicedge_rollout_canary_percent")
        if labels["model"] == "m"
    }


def both_at(admin: str, percent: float, timeout: float = 10.0) -> None:
    """Until both workers' canary share is `percent`."""
    deadline = time.monotonic() + timeout
    while canary_percent(admin) != {"0": percent, "1": percent}:
        assert time.monotonic() < deadline, canary_percent(admin)
        time.sleep(0.05)


def transitions(admin: str, action: str) -> dict[str, float]:
    """Each worker's count of rollout transitions of one kind."""
    fleet = httpx.get(f"{admin}/metrics", timeout=10).text
    return {
        labels["worker"]: value
        for labels, value in samples(fleet, "quicedge_rollout_transitions_total")
        if labels["action"] == action
    }


@contextlib.contextmanager
def two_workers(
    redis_url: str, tmp_path: Path, *canary: str, rollout: str = ROLLOUT
) -> Iterator[tuple[str, int]]:
    """`serve --workers 2` with the `rollout` (the one above), over a stable (v1) and a canary
    (v2, with the stand-in's `canary` flags): (the admin URL, the plain HTTP port)."""
    config = tmp_path / "edge.toml"
    config.write_text(rollout)
    with (
        sim_process("s1", "instant", "--served-model-name", "m", "--model-version", "v1") as s1,
        sim_process("s2", "instant", "--served-model-name", "m", *canary) as s2,
    ):
        http_port = free_port()
        server = ServeProcess(
            "--workers", "2", "--redis", redis_url, "--backend", s1 + "#model=m@v1",
            "--backend", s2 + "#model=m@v2", "--http", f"127.0.0.1:{http_port}",
            "--config", str(config),
        )  # fmt: skip
        try:
            wait_ready(server.admin_port)
            yield f"http://127.0.0.1:{server.admin_port}", http_port
        finally:
            server.stop()


def test_a_rollback_reaches_every_worker(redis_url: str, tmp_path: Path) -> None:
    with two_workers(redis_url, tmp_path, "--model-version", "v2") as (admin, _):
        assert canary_percent(admin) == {"0": 50.0, "1": 50.0}
        answer = httpx.post(f"{admin}/rollouts/m/rollback", timeout=10)
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-quicedge-workers"] == "2/2"
        assert canary_percent(admin) == {"0": 0.0, "1": 0.0}
        # Every worker refuses a promotion now (a rolled-back rollout must be restarted), and
        # the count says so.
        again = httpx.post(f"{admin}/rollouts/m/promote", timeout=10)
        assert again.status_code == 400 and again.headers["x-quicedge-workers"] == "0/2"
        assert httpx.get(f"{admin}/rollouts", timeout=10).status_code == 200


def test_a_rollback_one_worker_decides_reaches_the_other(redis_url: str, tmp_path: Path) -> None:
    # The canary answers 401 to the edge (it holds no key): every canary request fails.
    with two_workers(redis_url, tmp_path, "--api-key", "k") as (admin, http_port):
        assert canary_percent(admin) == {"0": 50.0, "1": 50.0}
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        # One kept-alive connection: one worker sees every canary request, the other none.
        with httpx.Client(base_url=f"http://127.0.0.1:{http_port}", timeout=10) as http:
            for _ in range(40):
                http.post("/v1/chat/completions", json=chat, headers={"x-canary": "1"})
                if 0.0 in canary_percent(admin).values():
                    break
        both_at(admin, 0.0)
        assert transitions(admin, "rollback") == {"0": 1.0, "1": 1.0}


def test_an_advance_one_worker_decides_is_followed_by_the_other(
    redis_url: str, tmp_path: Path
) -> None:
    ramping = ROLLOUT.replace("steps = [50.0]\nauto = false", "steps = [10.0, 50.0]\n"
                              "step_requests = 3\nstep_seconds = 0")  # fmt: skip
    with two_workers(redis_url, tmp_path, "--model-version", "v2", rollout=ramping) as served:
        admin, port = served
        assert canary_percent(admin) == {"0": 10.0, "1": 10.0}
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        # One kept-alive connection: one worker serves all three, the other none.
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
            for _ in range(3):
                r = http.post("/v1/chat/completions", json=chat, headers={"x-canary": "1"})
                assert r.status_code == 200, r.text
        both_at(admin, 50.0)
        assert transitions(admin, "advance") == {"0": 1.0, "1": 1.0}


async def test_a_worker_that_does_not_answer_is_counted_out(tmp_path: Path) -> None:
    from typing import Any

    from edge.fleet_metrics import FleetPlan
    from edge.worker_admin import WorkerAdmin

    taken: list[str] = []

    async def admin_app(scope: Any, receive: Any, send: Any) -> None:
        taken.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    plan = FleetPlan(str(tmp_path), workers=3)
    here, there = WorkerAdmin(plan, admin_app), WorkerAdmin(plan.for_worker(1), admin_app)
    await here.start()
    await there.start()  # worker 2 never started: no socket
    try:
        heads: list[dict[str, Any]] = []

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                heads.append(message)

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"", "more_body": False}

        scope = {"type": "http", "method": "POST", "path": "/rollouts/m/pause", "headers": []}
        await here.wrap(admin_app)(scope, receive, send)
        assert dict(heads[0]["headers"])[b"x-quicedge-workers"] == b"2/3"
        assert taken == ["/rollouts/m/pause", "/rollouts/m/pause"]  # worker 1, then itself
        # A read goes to the worker that took it only.
        await here.wrap(admin_app)({**scope, "method": "GET", "path": "/rollouts"}, receive, send)
        assert taken[-1] == "/rollouts" and len(taken) == 3
    finally:
        await here.aclose()
        await there.aclose()
