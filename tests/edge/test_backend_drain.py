"""`POST /backends/{name}/drain|undrain` on a real `quicedge serve --workers 2`: a held backend
takes no new request on any worker, finishes the answer it holds, and comes back."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from edge.admin import REFUSED_RECORD_GAP_S
from tests.deploy.processes import sim_process, wait_ready
from tests.edge.test_config_reload import LONG, audit_events, completion_tokens
from tests.helpers import free_port
from tests.transport.conftest import ServeProcess

CHAT = {"model": "default", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


@contextmanager
def edge(redis_url: str, *more: str) -> Iterator[tuple[ServeProcess, str, str, str]]:
    """Two workers over a slow (`s1`, GPU-paced) and an instant (`s2`) stand-in, round robin:
    (the process, its proxy URL, s1's name, s2's name)."""
    with (
        sim_process("s1", "h100-llama3-8b", "--served-model-name", "m") as s1,
        sim_process("s2", "instant", "--served-model-name", "m") as s2,
    ):
        port = free_port()
        proc = ServeProcess(
            "--workers", "2", "--redis", redis_url, "--backend", s1, "--backend", s2,
            "--policy", "round_robin", "--expose-backend-names", "--http", f"127.0.0.1:{port}",
            *more,
        )  # fmt: skip
        try:
            wait_ready(proc.admin_port)
            yield proc, f"http://127.0.0.1:{port}", s1.rpartition("/")[2], s2.rpartition("/")[2]
        finally:
            assert proc.stop() == 0, proc.errors()


async def served_by(url: str, times: int) -> set[str]:
    """Which backends `times` requests on new connections (so on both workers) reached."""
    names = set()
    for _ in range(times):
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            response = await http.post("/v1/chat/completions", json=CHAT)
            assert response.status_code == 200, response.text
            names.add(response.headers["x-quicedge-backend"])
    return names


def held(proc: ServeProcess) -> dict[str, float]:
    """`quicedge_backend_held` summed over the workers, by backend."""
    out: dict[str, float] = {}
    for line in proc.metrics().splitlines():
        if line.startswith("quicedge_backend_held{"):
            name = line.split('backend="')[1].split('"')[0]
            out[name] = out.get(name, 0.0) + float(line.rpartition(" ")[2])
    return out


async def test_a_drained_backend_finishes_its_answer_and_takes_no_new_one(redis_url: str) -> None:
    with edge(redis_url) as (proc, url, s1, s2):
        admin = f"http://127.0.0.1:{proc.admin_port}"
        assert await served_by(url, 8) == {s1, s2}
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            story = CHAT | LONG
            while True:  # an answer in progress on s1 (round robin: at most two tries)
                async with http.stream("POST", "/v1/chat/completions", json=story) as answer:
                    if answer.headers["x-quicedge-backend"] != s1:
                        await answer.aread()
                        continue
                    lines = answer.aiter_lines()
                    events = [await anext(lines)]
                    drained = await http.post(f"{admin}/backends/{s1}/drain")
                    assert drained.status_code == 200, drained.text
                    assert drained.headers["x-quicedge-workers"] == "2/2"
                    assert drained.json()["held"] is True
                    assert drained.json()["available"] is False
                    assert await served_by(url, 8) == {s2}
                    events += [line async for line in lines if line]
                    break
        assert events[-1] == "data: [DONE]"
        assert completion_tokens(events) == 300
        assert held(proc) == {s1: 2.0, s2: 0.0}
        async with httpx.AsyncClient(base_url=admin, timeout=10) as http:
            listed = {
                b["name"]: b["held"] for b in (await http.get("/backends")).json()["backends"]
            }
            undrained = await http.post(f"/backends/{s1}/undrain")
        assert listed == {s1: True, s2: False}
        assert undrained.status_code == 200 and undrained.headers["x-quicedge-workers"] == "2/2"
        assert await served_by(url, 8) == {s1, s2}
        assert held(proc) == {s1: 0.0, s2: 0.0}


async def test_every_backend_drained_is_a_clear_503_and_not_ready(redis_url: str) -> None:
    with edge(redis_url) as (proc, url, s1, s2):
        admin = httpx.AsyncClient(base_url=f"http://127.0.0.1:{proc.admin_port}", timeout=10)
        async with admin:
            for name in (s1, s2):
                assert (await admin.post(f"/backends/{name}/drain")).status_code == 200
            async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                refused = await http.post("/v1/chat/completions", json=CHAT)
            assert refused.status_code == 503
            assert refused.json()["error"]["code"] == "no_healthy_backend"
            assert "drained for maintenance" in refused.json()["error"]["message"]
            assert (await admin.get("/ready")).status_code == 503

            unknown = await admin.post("/backends/10.9.9.9:1/drain")
            assert unknown.status_code == 404 and "GET /backends lists them" in unknown.text
            wrong = await admin.post(f"/backends/{s1}/reboot")
            assert wrong.status_code == 404 and "use drain or undrain" in wrong.text
            get = await admin.get(f"/backends/{s1}/drain")
            assert get.status_code == 405 and get.headers["allow"] == "POST"


async def test_with_an_admin_token_actions_need_it_and_reads_do_not(
    redis_url: str, tmp_path: Path
) -> None:
    """Each worker's audit chain records the drain it took; one records the refused tries."""
    token_file = tmp_path / "admin-token"
    token_file.write_text("s3cret-admin-token\n")
    audit = tmp_path / "audit-{pid}.jsonl"
    args = ("--admin-token-file", str(token_file), "--audit-log", str(audit))
    with edge(redis_url, *args) as (proc, url, s1, s2):
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{proc.admin_port}", timeout=10
        ) as admin:
            began = time.monotonic()
            wrong = ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret"})
            for headers in wrong * 10:  # a flood: its audit lines are bounded in rate
                refused = await admin.post(f"/backends/{s1}/drain", headers=headers)
                assert refused.status_code == 401
                assert refused.headers["www-authenticate"] == "Bearer"
                assert refused.json()["error"]["code"] == "invalid_admin_token"
                assert "s3cret" not in refused.text
            flood_s = time.monotonic() - began
            assert held(proc) == {s1: 0.0, s2: 0.0}  # no worker took it
            assert (await admin.get("/backends")).status_code == 200  # reads stay open
            assert (await admin.get("/ready")).status_code == 200
            good = {"authorization": "Bearer s3cret-admin-token"}
            taken = await admin.post(f"/backends/{s1}/drain", headers=good)
            assert taken.status_code == 200 and taken.headers["x-quicedge-workers"] == "2/2"
        assert held(proc) == {s1: 2.0, s2: 0.0}
        assert await served_by(url, 6) == {s2}
    events = audit_events(tmp_path, "audit-*.jsonl")
    assert len(events) == 2  # a chain per worker
    drains = [e for chain in events for e in chain if e == ("admin", "backend.drain", s1)]
    assert len(drains) == 2  # each worker took it, and says so
    refused = [e for chain in events for e in chain if e[0] == "admin_refused"]
    assert set(refused) == {("admin_refused", "POST", f"/backends/{s1}/drain")}
    # ten a second at most, per worker (each answers some of the 30 connections)
    assert 1 <= len(refused) <= min(30, 2 * (int(flood_s / REFUSED_RECORD_GAP_S) + 1))


async def test_with_admin_token_reads_every_read_but_the_probes_needs_the_token(
    redis_url: str, tmp_path: Path
) -> None:
    token_file = tmp_path / "admin-token"
    token_file.write_text("s3cret-admin-token\n")
    args = ("--admin-token-file", str(token_file), "--admin-token-reads")
    with edge(redis_url, *args) as (proc, _, s1, _):
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{proc.admin_port}", timeout=10
        ) as admin:
            good = {"authorization": "Bearer s3cret-admin-token"}
            for path in ("/metrics", "/backends", "/tenants", "/rollouts"):
                refused = await admin.get(path)
                assert refused.status_code == 401, path
                assert refused.json()["error"]["code"] == "invalid_admin_token"
                assert "admin reads need" in refused.json()["error"]["message"]
                assert (await admin.get(path, headers=good)).status_code == 200, path
            for probe in ("/health", "/ready"):  # the orchestrator's probes carry no token
                assert (await admin.get(probe)).status_code == 200
            assert (await admin.post(f"/backends/{s1}/drain")).status_code == 401
