"""The edge exports its spans over OTLP/HTTP to OTEL_EXPORTER_OTLP_ENDPOINT, as the compose
stack's collector receives them (a stand-in collector here: an HTTP server that records)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
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
