"""A worker that dies and is started again starts its counters from zero under its own `worker`
label: the merged `/metrics` sums to what the workers serving now have served, and what a real
Prometheus's `increase()` sums over the workers is at most what was served, without the spike a
reset in a summed series would give."""

from __future__ import annotations

import os
import signal
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy.processes import completion, sim_process, wait_ready
from tests.deploy.test_prometheus import prometheus, query, wait_for
from tests.helpers import free_port
from tests.transport.conftest import ServeProcess
from tests.transport.test_workers_restart import _children

TOTAL = 'sum(quicedge_requests_total{job="quicedge"})'


def per_worker(admin: str, name: str = "quicedge_requests_total") -> dict[str, float]:
    text = httpx.get(f"{admin}/metrics", timeout=10).text
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                counts[s.labels["worker"]] = counts.get(s.labels["worker"], 0) + s.value
    return counts


def test_a_restarted_worker_resets_only_its_own_series(redis_url: str) -> None:
    http_port = free_port()
    with sim_process() as backend:
        server = ServeProcess(
            "--workers", "2", "--redis", redis_url, "--backend", backend,
            "--http", f"127.0.0.1:{http_port}",
        )  # fmt: skip
        try:
            wait_ready(server.admin_port)
            admin = f"http://127.0.0.1:{server.admin_port}"
            edge = f"http://127.0.0.1:{http_port}"
            with prometheus([f"127.0.0.1:{server.admin_port}"]) as url:
                wait_for(url, 'up{job="quicedge"}', lambda r: r and r[0]["value"][1] == "1")
                served = 0
                while len(per_worker(admin)) < 2 or min(per_worker(admin).values()) == 0:
                    assert completion(edge) == 200  # a new connection: either worker
                    served += 1
                    assert served < 200
                wait_for(url, TOTAL, lambda r: r and float(r[0]["value"][1]) == served)
                before = per_worker(admin)
                workers = _children(server.proc.pid)
                os.kill(min(workers), signal.SIGKILL)
                deadline = time.monotonic() + 30
                while not (_children(server.proc.pid) - workers):  # started again
                    assert time.monotonic() < deadline
                    time.sleep(0.05)
                wait_ready(server.admin_port)
                wait_for(
                    url, "max(quicedge_worker_starts)", lambda r: r and r[0]["value"][1] == "2"
                )
                for _ in range(10):
                    assert completion(edge) == 200
                after = per_worker(admin)
                starts = per_worker(admin, "quicedge_worker_starts")
                lost = before[next(w for w, n in starts.items() if n == 2)]
                now = served + 10 - lost
                assert sum(after.values()) == now
                wait_for(url, TOTAL, lambda r: r and float(r[0]["value"][1]) == now)
                increase = query(url, 'sum(increase(quicedge_requests_total{job="quicedge"}[5m]))')
                grew = float(increase[0]["value"][1])
                # At most what was served (extrapolation may add a little): a series' first
                # sample is not counted, and a reset is not taken as all of it being new.
                assert 0 < grew <= 1.3 * (served + 10), (grew, served)
        finally:
            assert server.stop() == 0, server.errors()
