"""The `backend` label of the per-request metrics names the backends of the fleet: a backend that
leaves it (discovery, a reload) leaves `/metrics` too, so that the series do not pile up over an
edge's life as backends come and go (a pod rescheduled gets a new address, hence a new name)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy.processes import completion, sim_process, wait_ready
from tests.helpers import free_port
from tests.transport.conftest import ServeProcess

PER_REQUEST = (
    "quicedge_ttft_seconds_count",
    "quicedge_upstream_ttft_seconds_count",
    "quicedge_inter_token_seconds_count",
    "quicedge_upstream_requests_total",
)


def backends_labelled(text: str) -> dict[str, set[str]]:
    """Per-request series name → the `backend` values it has."""
    found: dict[str, set[str]] = {name: set() for name in PER_REQUEST}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in found:
                found[sample.name].add(sample.labels["backend"])
    return found


def test_a_backend_removed_by_a_reload_leaves_the_per_request_series(
    tmp_path: Path, redis_url: str
) -> None:
    http_port = free_port()
    with sim_process("s1") as first, sim_process("s2") as second:
        old, new = first.rpartition("/")[2], second.rpartition("/")[2]
        config = tmp_path / "quicedge.toml"
        head = '[proxy]\nbackends = ["{}"]\n'
        config.write_text(head.format(first))
        server = ServeProcess(
            "--config", str(config), "--workers", "2", "--redis", redis_url,
            "--http", f"127.0.0.1:{http_port}",
        )  # fmt: skip
        try:
            wait_ready(server.admin_port)
            edge = f"http://127.0.0.1:{http_port}"
            admin = f"http://127.0.0.1:{server.admin_port}"
            for _ in range(6):  # new connections: both workers take some
                assert completion(edge, stream=True) == 200
            before = backends_labelled(httpx.get(f"{admin}/metrics", timeout=10).text)
            assert all(values == {old} for values in before.values()), before
            config.write_text(head.format(second))
            reload = httpx.post(f"{admin}/config/reload", timeout=30)
            assert reload.status_code == 200 and reload.headers["x-quicedge-workers"] == "2/2"
            deadline = time.monotonic() + 20
            while True:  # every worker has let the removed backend go (nothing in flight)
                text = httpx.get(f"{admin}/metrics", timeout=10).text
                healthy = {
                    s.labels["backend"]
                    for family in text_string_to_metric_families(text)
                    for s in family.samples
                    if s.name == "quicedge_backend_healthy"
                }
                if healthy == {new}:
                    break
                assert time.monotonic() < deadline, healthy
                time.sleep(0.1)
            for _ in range(4):
                assert completion(edge, stream=True) == 200
            after = backends_labelled(httpx.get(f"{admin}/metrics", timeout=10).text)
            assert all(values == {new} for values in after.values()), after
        finally:
            assert server.stop() == 0, server.errors()
