"""`/metrics` of `quicedge serve --workers N` reports every worker; `?worker=self` one of them."""

from __future__ import annotations

import httpx
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from edge.fleet_metrics import merge_expositions
from edge.telemetry import Metrics
from tests.deploy.processes import completion, sim_process, wait_ready
from tests.helpers import free_port
from tests.transport.conftest import ServeProcess

REQUESTS = 40


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    return [
        (s.labels, s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    ]


def test_merge_labels_every_sample_with_its_worker_and_marks_a_silent_one_down() -> None:
    texts: dict[int, bytes | None] = {}
    for index, count in ((0, 3), (1, 5)):
        registry = CollectorRegistry()
        metrics = Metrics(registry)
        for _ in range(count):
            metrics.requests.labels("/v1/completions", "200", "default").inc()
            metrics.ttft.labels("h3", "false", "hit", "b", "default").observe(0.02)
        texts[index] = generate_latest(registry)
    texts[2] = None
    merged = merge_expositions(texts).decode()
    requests = samples(merged, "quicedge_requests_total")
    assert sorted((labels["worker"], value) for labels, value in requests) == [
        ("0", 3.0),
        ("1", 5.0),
    ]
    counts = samples(merged, "quicedge_ttft_seconds_count")
    assert sum(value for _, value in counts) == 8
    up_samples = samples(merged, "quicedge_metrics_worker_up")
    up = {labels["worker"]: value for labels, value in up_samples}
    assert up == {"0": 1.0, "1": 1.0, "2": 0.0}
    # One TYPE line per family, as the exposition format requires.
    assert merged.count("# TYPE quicedge_requests_total counter") == 1


def test_two_workers_count_every_request(redis_url: str) -> None:
    http_port = free_port()
    with sim_process() as backend:
        server = ServeProcess(
            "--workers", "2", "--redis", redis_url, "--backend", backend,
            "--http", f"127.0.0.1:{http_port}", "--policy", "round_robin",
        )  # fmt: skip
        try:
            wait_ready(server.admin_port)
            statuses = [completion(f"http://127.0.0.1:{http_port}") for _ in range(REQUESTS)]
            assert statuses == [200] * REQUESTS
            admin = f"http://127.0.0.1:{server.admin_port}"
            fleet = httpx.get(f"{admin}/metrics", timeout=10).text
            per_worker: dict[str, float] = {}
            for labels, value in samples(fleet, "quicedge_requests_total"):
                per_worker[labels["worker"]] = per_worker.get(labels["worker"], 0) + value
            assert sum(per_worker.values()) == REQUESTS
            # New connections spread over both workers (SO_REUSEPORT hashes the client port):
            # the sum is not one worker's count.
            assert set(per_worker) == {"0", "1"} and all(v > 0 for v in per_worker.values())
            up = samples(fleet, "quicedge_metrics_worker_up")
            assert sorted(labels["worker"] for labels, value in up if value == 1) == ["0", "1"]
            own = httpx.get(f"{admin}/metrics?worker=self", timeout=10).text
            mine = samples(own, "quicedge_requests_total")
            assert mine and all("worker" not in labels for labels, _ in mine)
            assert sum(v for _, v in mine) in per_worker.values()
            # The rest of the admin listener is unchanged.
            assert httpx.get(f"{admin}/backends", timeout=10).status_code == 200
        finally:
            assert server.stop() == 0
