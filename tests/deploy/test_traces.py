"""The edge exports its spans, and with `--audit-otlp` its audit records as log records, over
OTLP/HTTP to OTEL_EXPORTER_OTLP_ENDPOINT, as the compose stack's collector receives them (a
stand-in collector here: an HTTP server that records)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tests.deploy.processes import completion, sim_process, wait_ready
from tests.helpers import free_port
from tests.transport.conftest import ServeProcess


@contextmanager
def collector() -> Iterator[tuple[str, list[tuple[str, bytes]]]]:
    """(endpoint, received (path, body) pairs) of an OTLP/HTTP receiver on a free port."""
    received: list[tuple[str, bytes]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["content-length"]))
            received.append((self.path, body))
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", received
    finally:
        server.shutdown()
        server.server_close()


def test_serve_exports_request_spans_to_the_otlp_endpoint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    http_port = free_port()
    with collector() as (endpoint, received), sim_process() as backend:
        monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
        monkeypatch.setenv("OTEL_SERVICE_NAME", "quicedge-under-test")
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")  # ms: export soon
        server = ServeProcess("--backend", backend, "--http", f"127.0.0.1:{http_port}")
        try:
            wait_ready(server.admin_port)
            assert completion(f"http://127.0.0.1:{http_port}", stream=True) == 200
            deadline = time.monotonic() + 30
            names: set[str] = set()
            services: set[str] = set()
            while "quicedge.request" not in names:
                assert time.monotonic() < deadline, f"no request span exported: {received}"
                time.sleep(0.1)
                for path, body in list(received):
                    assert path == "/v1/traces"
                    export = ExportTraceServiceRequest.FromString(body)
                    for resource in export.resource_spans:
                        services.update(
                            a.value.string_value
                            for a in resource.resource.attributes
                            if a.key == "service.name"
                        )
                        for scope in resource.scope_spans:
                            names.update(span.name for span in scope.spans)
            assert services == {"quicedge-under-test"}
        finally:
            assert server.stop() == 0


def test_serve_exports_audit_records_where_the_spans_go(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`--audit-otlp` without an endpoint of its own uses OTEL_EXPORTER_OTLP_ENDPOINT, as the
    spans do: both reach the one collector, and each log record names its line's hash."""
    http_port = free_port()
    path = tmp_path / "audit.jsonl"
    with collector() as (endpoint, received), sim_process() as backend:
        monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")  # ms: export soon
        server = ServeProcess("--backend", backend, "--http", f"127.0.0.1:{http_port}",
                              "--audit-log", str(path), "--audit-otlp",
                              "--audit-otlp-batch-delay", "0.2")  # fmt: skip
        try:
            wait_ready(server.admin_port)
            assert completion(f"http://127.0.0.1:{http_port}", stream=True) == 200
            deadline = time.monotonic() + 30
            hashes: set[str] = set()
            while (
                not (path.exists() and path.read_text().strip())
                or not hashes
                or not any(p == "/v1/traces" for p, _ in list(received))
            ):
                assert time.monotonic() < deadline, f"not exported: {[p for p, _ in received]}"
                time.sleep(0.1)
                for p, body in list(received):
                    if p == "/v1/logs":
                        for resource in ExportLogsServiceRequest.FromString(body).resource_logs:
                            for scope in resource.scope_logs:
                                hashes.update(
                                    a.value.string_value
                                    for record in scope.log_records
                                    for a in record.attributes
                                    if a.key == "quicedge.audit.hash"
                                )
        finally:
            assert server.stop() == 0
    (line,) = path.read_text().splitlines()
    assert json.loads(line)["hash"] in hashes
