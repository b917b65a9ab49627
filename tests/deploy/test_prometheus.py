"""The Prometheus side: config and rules through promtool, the dashboard's queries against what
the edge and SGLang export, and a real Prometheus scraping a running edge."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import yaml

from certs import ensure_dev_certificates
from tests.deploy.dns_server import dns_server
from tests.deploy.exported import edge_metric_names
from tests.deploy.processes import completion, sim_process, wait_ready
from tests.helpers import free_port, wait_for_tcp
from tests.transport.conftest import ServeProcess
from tests.transport.h3client import h3_connect

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "quicedge.json"

# What SGLang exports with --enable-metrics (python/sglang/srt/metrics/collector.py; the names
# the stand-in exports too, which `test_the_stand_in_exports_the_sglang_series_queried` checks).
SGLANG_METRICS = {
    "sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:num_used_tokens",
    "sglang:token_usage", "sglang:gen_throughput", "sglang:cache_hit_rate",
    "sglang:prompt_tokens_total", "sglang:generation_tokens_total", "sglang:cached_tokens_total",
    "sglang:num_requests_total", "sglang:num_aborted_requests_total",
    *(f"sglang:{h}_{s}" for h in ("time_to_first_token_seconds", "inter_token_latency_seconds",
                                  "e2e_request_latency_seconds", "queue_time_seconds")
      for s in ("bucket", "count", "sum")),
}  # fmt: skip
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and",
                "or", "unless", "offset", "le", "inf", "nan"}  # fmt: skip


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("promtool")
    assert binary, "promtool is required (Debian package prometheus: make test installs it)"
    return subprocess.run([binary, *args], capture_output=True, text=True, timeout=60)


def test_promtool_accepts_the_config_and_the_rules() -> None:
    done = promtool("check", "config", str(ROOT / "deploy" / "prometheus" / "prometheus.yml"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 rule files found" in done.stdout + done.stderr
    done = promtool("check", "rules", str(ROOT / "deploy" / "prometheus" / "rules.yml"))
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_rules_compute_what_they_claim() -> None:
    """promtool's unit tests: the per-pod in-flight sum over workers and backends, and the
    alert on a silent worker."""
    done = promtool("test", "rules", str(ROOT / "deploy" / "prometheus" / "rules_test.yml"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_promtool_rejects_a_broken_rule(tmp_path: Path) -> None:
    broken = tmp_path / "rules.yml"
    broken.write_text("groups:\n- name: x\n  rules:\n  - record: a:b\n    expr: sum(rate(x[1m])\n")
    assert promtool("check", "rules", str(broken)).returncode != 0


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, expression) for every query of the dashboard."""
    dashboard = json.loads(DASHBOARD.read_text())
    return [
        (panel["title"], target["expr"])
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
    ]


def metric_names(expr: str) -> set[str]:
    """Series names an expression reads: identifiers not called as functions, outside label
    matchers, grouping clauses, strings and ranges."""
    text = re.sub(r'"[^"]*"', "", expr)
    text = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", text)
    text = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", " ", text)
    names = set()
    for match in re.finditer(r"[a-zA-Z_:][a-zA-Z0-9_:]*", text):
        rest = text[match.end() :].lstrip()
        if rest.startswith("(") or match.group(0).lower() in PROMQL_WORDS:
            continue
        names.add(match.group(0))
    return names


def test_every_dashboard_query_is_valid_promql(tmp_path: Path) -> None:
    queries = dashboard_queries()
    assert len(queries) >= 20
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query{i}", "expr": expr} for i, (_, expr) in enumerate(queries)
    ]}]}  # fmt: skip
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump(rules))
    done = promtool("check", "rules", str(path))
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_metric_the_dashboard_queries_is_exported() -> None:
    exported = edge_metric_names() | SGLANG_METRICS
    used: set[str] = set()
    for title, expr in dashboard_queries():
        names = metric_names(expr)
        assert names, f"{title}: no metric found in {expr}"
        used |= names
        assert names <= exported, f"{title}: {names - exported} exported by neither"
    needed = {"quicedge_ttft_seconds_bucket", "quicedge_upstream_errors_total",
              "sglang:num_queue_reqs", "sglang:token_usage",
              "sglang:cached_tokens_total"}  # fmt: skip
    assert needed <= used
    rules = yaml.safe_load((ROOT / "deploy" / "prometheus" / "rules.yml").read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            names = {
                n for n in metric_names(rule["expr"]) if ":" not in n or n.startswith("sglang")
            }
            assert names <= exported | {"up"}, rule


def test_the_stand_in_exports_the_sglang_series_queried() -> None:
    used = set().union(*(metric_names(e) for _, e in dashboard_queries()))
    with sim_process() as backend:
        completion(backend)
        text = httpx.get(f"{backend}/metrics", timeout=10).text
    exposed = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line[:1] != "#"}
    assert {n for n in used if n.startswith("sglang:")} <= exposed


@contextmanager
def prometheus(targets: list[str]) -> Iterator[str]:
    """A real Prometheus on a free loopback port scraping `targets` every second."""
    binary = shutil.which("prometheus")
    assert binary, "prometheus is required (Debian package prometheus: make test installs it)"
    port = free_port()
    with tempfile.TemporaryDirectory() as directory:
        config = Path(directory) / "prometheus.yml"
        config.write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s"},
            "scrape_configs": [{"job_name": "quicedge", "static_configs": [{"targets": targets}]}],
        }))  # fmt: skip
        proc = subprocess.Popen(
            [binary, f"--config.file={config}", f"--web.listen-address=127.0.0.1:{port}",
             f"--storage.tsdb.path={directory}/data"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            wait_for_tcp("127.0.0.1", port, timeout=60)
            url = f"http://127.0.0.1:{port}"
            wait_ready_prometheus(url, proc)
            yield url
        finally:
            proc.terminate()
            proc.wait(30)


def wait_ready_prometheus(url: str, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    """Wait for `/-/ready`: Prometheus listens before it has opened its storage, and answers
    every query 503 until then."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, f"prometheus exited with {proc.returncode}"
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/-/ready", timeout=5).status_code == 200:
                return
        assert time.monotonic() < deadline, "prometheus did not become ready in 60 s"
        time.sleep(0.2)


def query(url: str, expr: str) -> list[dict[str, Any]]:
    answer = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=10).json()
    assert answer["status"] == "success", answer
    return list(answer["data"]["result"])


async def h3_streams(port: int, count: int) -> list[int]:
    """`count` streamed completions over HTTP/3 (one QUIC connection); their statuses."""
    body = json.dumps({"model": "default", "prompt": "Hello", "max_tokens": 4, "stream": True})
    statuses = []
    async with h3_connect(port, ensure_dev_certificates().ca_cert) as client:
        for _ in range(count):
            r = await client.fetch(
                "POST", "/v1/completions", body=body.encode(),
                headers=[(b"content-type", b"application/json")],
            )  # fmt: skip
            assert r.body.rstrip().endswith(b"data: [DONE]")
            statuses.append(r.status)
    return statuses


def wait_for(url: str, expr: str, check: Any, timeout: float = 60.0) -> list[dict[str, Any]]:
    """Query until `check(result)` holds; the result."""
    deadline = time.monotonic() + timeout
    while True:
        result = query(url, expr)
        if check(result):
            return result
        assert time.monotonic() < deadline, f"{expr}: Prometheus has {result}"
        time.sleep(0.5)


def next_scrape(url: str) -> None:
    """Until Prometheus has scraped again."""
    last = float(query(url, "max(timestamp(up))")[0]["value"][1])
    wait_for(url, "max(timestamp(up))", lambda r: float(r[0]["value"][1]) > last)


def test_a_real_prometheus_scrapes_the_edge_and_the_dashboard_shows_h3_ttft(
    redis_url: str,
) -> None:
    h1, h3 = 8, 4
    http_port = free_port()
    with sim_process() as backend:
        server = ServeProcess(
            "--workers", "2", "--redis", redis_url, "--backend", backend,
            "--http", f"127.0.0.1:{http_port}",
        )  # fmt: skip
        try:
            wait_ready(server.admin_port)
            with prometheus([f"127.0.0.1:{server.admin_port}"]) as url:
                # Scraped once before any request, so rate() sees the requests as an increase.
                wait_for(url, 'up{job="quicedge"}', lambda r: r and r[0]["value"][1] == "1")
                edge = f"http://127.0.0.1:{http_port}"
                assert [completion(edge, stream=True) for _ in range(h1)] == [200] * h1
                assert asyncio.run(h3_streams(server.h3_port, h3)) == [200] * h3
                total = 'sum(quicedge_requests_total{job="quicedge"})'
                wait_for(url, total, lambda r: r and float(r[0]["value"][1]) == h1 + h3)
                up = query(url, "sum(quicedge_metrics_worker_up)")
                assert float(up[0]["value"][1]) == 2
                ttft = query(url, "sum by (transport) (quicedge_ttft_seconds_count)")
                counts = {r["metric"]["transport"]: float(r["value"][1]) for r in ttft}
                assert counts == {"h1": h1, "h3": h3}
                # The dashboard's panels: the mean shows the first HTTP/3 requests at once. The
                # quantiles are built on rate(), which sees a series from its second scrape on; a
                # series is per worker and cache outcome, so batches go on (each on a new
                # connection, to either worker) until one increased a series already scraped.
                panels = dict(dashboard_queries())
                mean = query(url, panels["Mean TTFT by transport since start"])
                h3_mean = [float(x["value"][1]) for x in mean if x["metric"]["transport"] == "h3"]
                assert len(h3_mean) == 1 and 0 < h3_mean[0] < 30
                p95 = panels["TTFT by transport (p50, p95)"]
                deadline = time.monotonic() + 60
                while True:
                    next_scrape(url)
                    lines = query(url, p95)
                    h3_values = [
                        x["value"][1] for x in lines if x["metric"]["transport"] == "h3"
                    ]  # fmt: skip
                    if h3_values and h3_values[0] != "NaN":
                        break
                    assert time.monotonic() < deadline, f"{p95}: {lines}"
                    assert asyncio.run(h3_streams(server.h3_port, h3)) == [200] * h3
                value = float(h3_values[0])
                assert 0 < value < 30
        finally:
            assert server.stop() == 0


def alert_expr(name: str) -> str:
    """The expression of the alert `name` in deploy/prometheus/rules.yml."""
    rules = yaml.safe_load((ROOT / "deploy" / "prometheus" / "rules.yml").read_text())
    (expr,) = [r["expr"] for g in rules["groups"] for r in g["rules"] if r.get("alert") == name]
    return str(expr)


def test_the_no_healthy_backend_alert_sees_an_edge_whose_discovery_found_none(
    tmp_path: Path,
) -> None:
    """Discovery empties the backend list when the name is gone (every backend pod down, an
    empty EndpointSlice): /ready fails, and the edge exports no `quicedge_backend_*` sample at
    all, so the alert must not need one to fire."""
    config = tmp_path / "edge.toml"
    with dns_server() as (_, nameserver):
        config.write_text(
            f'[discovery]\nmode = "dns"\nnames = ["gone.fleet.test:30000"]\n'
            f'nameservers = ["{nameserver}"]\ninterval = 0.5\n'
        )
        server = ServeProcess("--config", str(config), "--workers", "1")
        try:
            ready = httpx.get(f"http://127.0.0.1:{server.admin_port}/ready", timeout=10)
            assert (ready.status_code, ready.json()["backends"]) == (503, 0)
            with prometheus([f"127.0.0.1:{server.admin_port}"]) as url:
                wait_for(url, 'up{job="quicedge"}', lambda r: r and r[0]["value"][1] == "1")
                firing = query(url, alert_expr("QuicedgeNoHealthyBackend"))
                assert [r["metric"]["instance"] for r in firing] == [
                    f"127.0.0.1:{server.admin_port}"
                ]
        finally:
            assert server.stop() == 0
