"""The audit log's OpenTelemetry copy: each line reaches a real OTLP/HTTP receiver as a log
record carrying its tenant, decision, rules and chain hash; a dead or silent collector drops
records (counted) while the file chain is written whole and on time."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import opentelemetry.exporter.otlp.proto.http._log_exporter as log_exporter_module
import pytest
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

import edge.audit_export as audit_export_module
from backends.sim import SimConfig, SimServer
from edge.admission.settings import AdmissionSettings, TenantSettings
from edge.admission.tenants import key_digest
from edge.audit import GENESIS, AuditConfig, AuditLog, verify
from edge.audit_export import EVENT_NAME, check_otlp
from edge.policy.config import PolicyConfig
from edge.tracing import ATTRIBUTE_MAX
from tests.deploy.test_traces import collector
from tests.edge.conftest import client, fast_config, run_edge
from tests.helpers import free_port, wait_until


def value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind is not None else None


def log_records(received: list[tuple[str, bytes]]) -> list[dict[str, Any]]:
    """Every log record the receiver decoded: body, event name, attributes, service name."""
    out = []
    for path, body in list(received):
        assert path == "/v1/logs"
        export = ExportLogsServiceRequest.FromString(body)
        for resource in export.resource_logs:
            service = {a.key: value(a.value) for a in resource.resource.attributes}
            for scope in resource.scope_logs:
                for record in scope.log_records:
                    out.append({
                        "body": value(record.body),
                        "event_name": record.event_name,
                        "time_unix_nano": record.time_unix_nano,
                        "attributes": {a.key: value(a.value) for a in record.attributes},
                        "service": service.get("service.name"),
                        "scope": scope.scope.name,
                    })  # fmt: skip
    return out


POLICY = {
    "rules": [
        {"id": "no-secrets", "action": "deny", "patterns": ["password"]},
        {"id": "email", "action": "redact", "patterns": [r"[\w.]+@[\w.]+"]},
    ]
}


async def test_each_line_reaches_the_collector_with_its_tenant_decision_and_hash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_SERVICE_NAME", "quicedge-audit-test")
    path = tmp_path / "audit.jsonl"
    sim = SimConfig(name="s1", port=0, profile="instant", seed=0)
    with collector() as (endpoint, received):
        async with SimServer(sim) as backend:
            cfg = fast_config([backend.url])
            cfg.admission = AdmissionSettings(tenants=[
                TenantSettings(name="acme", tier="gold", api_key_sha256=[key_digest("sk-acme")]),
            ])  # fmt: skip
            audit = AuditConfig(path=str(path), otlp=True, otlp_endpoint=f"{endpoint}/v1/logs",
                                otlp_batch_delay=0.1)  # fmt: skip
            policies = PolicyConfig.from_mapping(POLICY)
            async with run_edge(cfg, policies=policies, audit=audit) as edge:
                async with client(edge) as http:
                    headers = {"authorization": "Bearer sk-acme"}
                    for prompt in ("hello there", "mail bob@corp.io", "my password is"):
                        body = {"model": "default", "prompt": prompt, "max_tokens": 4}
                        response = await http.post("/v1/completions", json=body,
                                                   headers=headers)  # fmt: skip
                        assert response.status_code in (200, 403), response.text
                    plain = await http.post("/v1/completions", json={"prompt": "hi",
                                            "model": "default", "max_tokens": 4})  # fmt: skip
                    assert plain.status_code == 200
                log = edge.wiring.audit
                assert log is not None and log.export is not None
                await log.flush()
                lines = path.read_text().splitlines()
                assert len(lines) == 4
                hashes = {json.loads(line)["hash"] for line in lines}

                def exported_hashes() -> set[str]:
                    return {r["attributes"]["quicedge.audit.hash"] for r in log_records(received)}

                await wait_until(lambda: hashes <= exported_hashes(), 30)
                metrics = (await httpx.AsyncClient().get(f"{edge.admin_url}/metrics")).text
    assert verify([str(path)], start=GENESIS).ok
    by_hash = {r["attributes"]["quicedge.audit.hash"]: r for r in log_records(received)}
    seen = []
    for line in lines:
        record = json.loads(line)
        exported = by_hash[record["hash"]]
        attributes = exported["attributes"]
        assert exported["body"] == line  # the line itself: it verifies against the chain
        assert exported["event_name"] == EVENT_NAME
        assert exported["service"] == "quicedge-audit-test"
        assert exported["scope"] == "quicedge.audit"
        assert exported["time_unix_nano"] == int(record["ts"] * 1e9)
        assert attributes["quicedge.audit.prev"] == record["prev"]
        assert attributes["quicedge.request_id"] == record["request_id"]
        assert attributes["http.route"] == "/v1/completions"
        assert attributes["http.response.status_code"] == record["status"]
        seen.append((attributes["quicedge.tenant"], attributes["quicedge.policy.decision"],
                     attributes.get("quicedge.policy.rules", [])))  # fmt: skip
    assert seen == [
        ("acme", "allow", []),
        ("acme", "redact", ["email"]),
        ("acme", "deny", ["no-secrets"]),
        ("anonymous", "allow", []),
    ]
    assert "quicedge_audit_exported_total 4.0" in metrics
    assert 'quicedge_audit_export_dropped_total{reason="queue_full"} 0.0' in metrics
    assert 'quicedge_audit_export_dropped_total{reason="failed"} 0.0' in metrics


@contextmanager
def dead_collector(kind: str) -> Iterator[str]:
    """An OTLP endpoint that refuses connections, or one that accepts and never answers."""
    if kind == "refused":
        yield f"http://127.0.0.1:{free_port()}/v1/logs"
        return
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)  # the kernel completes the handshakes; nothing ever reads or answers
    try:
        yield f"http://127.0.0.1:{silent.getsockname()[1]}/v1/logs"
    finally:
        silent.close()


def entry(i: int) -> dict[str, Any]:
    return {"ts": 1.0 + i, "request_id": f"r{i}", "tenant": "t", "decision": "allow",
            "status": 200, "_prompt": f"prompt {i}"}  # fmt: skip


@pytest.mark.parametrize("kind", ["refused", "silent"])
async def test_a_dead_collector_drops_copies_but_not_a_line_of_the_file(
    tmp_path: Path, kind: str
) -> None:
    path = tmp_path / "audit.jsonl"
    total, batches = 300, 10
    # An export of a batch may hang for its whole 60 s timeout; the file must not wait for it.
    config = AuditConfig(path=str(path), otlp=True, otlp_queue_size=8, otlp_batch_delay=0.05,
                         otlp_timeout=60.0)  # fmt: skip
    with dead_collector(kind) as endpoint:
        config.otlp_endpoint = endpoint
        log = AuditLog(config)
        await log.start()
        export = log.export
        assert export is not None
        try:
            for b in range(batches):
                for i in range(b * total // batches, (b + 1) * total // batches):
                    log.record(entry(i))
                # Writes are done well inside one export timeout, or they waited for one.
                await asyncio.wait_for(log.flush(), 20)
            assert log.written == total and log.dropped == 0
            assert export.dropped_full > 0 and export.exported == 0
            assert export.depth <= config.otlp_queue_size
            # Closing gives what is queued a grace, then counts it as lost instead of waiting.
            await asyncio.wait_for(asyncio.to_thread(export.close, 0.5), 20)
        finally:
            await log.aclose()
    result = verify([str(path)], start=GENESIS)
    assert result.ok and result.lines == total
    assert export.exported == 0
    assert export.dropped_full + export.dropped_failed == total  # every copy accounted for
    assert export.depth == 0


def test_export_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="audit.otlp_queue_size"):
        AuditConfig.from_mapping({"path": "x", "otlp_queue_size": 0})
    with pytest.raises(ValueError, match="audit.otlp_timeout"):
        AuditConfig.from_mapping({"path": "x", "otlp_timeout": 0})
    assert AuditConfig.from_mapping({"path": "x"}).otlp is False  # off by default
    assert AuditLog(AuditConfig(path="x")).export is None


def test_serve_without_the_otlp_extra_says_so_in_one_line(tmp_path: Path) -> None:
    # Stands for an install without the `otlp` extra: the import of the log exporter fails.
    code = (
        "import sys; sys.modules['opentelemetry.exporter.otlp.proto.http._log_exporter'] = None;"
        "from edge.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    args = ["serve", "--backend", "http://127.0.0.1:9", "--audit-log",
            str(tmp_path / "a.jsonl"), "--audit-otlp"]  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "audit.otlp" in lines[0] and "quicedge[otlp]" in lines[0]


async def test_a_client_chosen_model_name_is_cut_in_the_line_and_its_copy(
    tmp_path: Path,
) -> None:
    """`/generate` serves any model name: the line keeps 256 characters of it (as the span's
    `gen_ai.request.model`), so its copy's body and attribute are bounded too."""
    path = tmp_path / "audit.jsonl"
    sim = SimConfig(name="s1", port=0, profile="instant", seed=0)
    with collector() as (endpoint, received):
        async with SimServer(sim) as backend:
            audit = AuditConfig(path=str(path), otlp=True, otlp_endpoint=f"{endpoint}/v1/logs",
                                otlp_batch_delay=0.05)  # fmt: skip
            async with run_edge(fast_config([backend.url]), audit=audit) as edge:
                async with client(edge) as http:
                    body = {"text": "hi", "model": "M" * 100_000,
                            "sampling_params": {"max_new_tokens": 2}}  # fmt: skip
                    assert (await http.post("/generate", json=body)).status_code == 200
                log = edge.wiring.audit
                assert log is not None
                await log.flush()
                await wait_until(lambda: len(log_records(received)) == 1, 30)
    (line,) = path.read_text().splitlines()
    assert json.loads(line)["model"] == "M" * ATTRIBUTE_MAX + "..."
    (exported,) = log_records(received)
    assert exported["body"] == line
    assert exported["attributes"]["gen_ai.request.model"] == "M" * ATTRIBUTE_MAX + "..."
    assert verify([str(path)], start=GENESIS).ok


@pytest.mark.parametrize(
    ("env", "service"),
    [
        ({"OTEL_RESOURCE_ATTRIBUTES": "service.name=edge-eu,deployment.environment=prod"},
         "edge-eu"),
        ({"OTEL_RESOURCE_ATTRIBUTES": "service.name=edge-eu", "OTEL_SERVICE_NAME": "edge-us"},
         "edge-us"),
        ({}, "quicedge"),
    ],
)  # fmt: skip
async def test_the_service_name_follows_the_sdk_variables(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, env: dict[str, str], service: str
) -> None:
    """As the spans' (edge/tracing.py): `OTEL_SERVICE_NAME`, else `OTEL_RESOURCE_ATTRIBUTES`'
    `service.name`, else `quicedge`; the other resource attributes are kept."""
    for name in ("OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES"):
        monkeypatch.delenv(name, raising=False)
    for name, text in env.items():
        monkeypatch.setenv(name, text)
    with collector() as (endpoint, received):
        config = AuditConfig(path=str(tmp_path / "audit.jsonl"), otlp=True,
                             otlp_endpoint=f"{endpoint}/v1/logs",
                             otlp_batch_delay=0.05)  # fmt: skip
        log = AuditLog(config)
        await log.start()
        try:
            log.record(entry(0))
            await log.flush()
            await wait_until(lambda: len(log_records(received)) == 1, 30)
        finally:
            await log.aclose()
    (exported,) = log_records(received)
    assert exported["service"] == service


@pytest.mark.parametrize(
    "variables",
    [
        {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
        {"OTEL_EXPORTER_OTLP_LOGS_PROTOCOL": "http/json"},
        {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
         "OTEL_EXPORTER_OTLP_LOGS_PROTOCOL": "grpc"},
    ],
)  # fmt: skip
def test_an_otlp_protocol_the_exporter_does_not_speak_is_one_line(
    tmp_path: Path, variables: dict[str, str]
) -> None:
    """The log exporter speaks OTLP/HTTP with protobuf only: told gRPC, it would post every
    batch to a gRPC port (4317) and lose each record. `serve` says so at start, as for spans."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")} | variables
    args = ["serve", "--backend", "http://127.0.0.1:9", "--check", "--audit-log",
            str(tmp_path / "a.jsonl"), "--audit-otlp"]  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "edge.cli", *args], env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    (name,) = [n for n, v in variables.items() if v != "http/protobuf"]
    assert "audit.otlp" in lines[0] and name in lines[0] and "http/protobuf" in lines[0]
    # the protocol it speaks, named in the logs' own variable over the general one, is taken
    check_otlp({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                "OTEL_EXPORTER_OTLP_LOGS_PROTOCOL": "http/protobuf"})  # fmt: skip


async def test_a_batch_past_the_collectors_request_bound_is_sent_in_parts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With `include_prompts`, a line is as long as its prompt: 512 lines of 128 KiB made one
    request over the exporter's bound (64 MiB), which dropped the whole batch, every record in
    it. Here the bound is 1 MiB, the prompts 64 KiB: a batch of 40 goes out in parts."""
    monkeypatch.setattr(log_exporter_module, "_DEFAULT_MAX_REQUEST_SIZE", 1024 * 1024)
    path = tmp_path / "audit.jsonl"
    total = 40
    with collector() as (endpoint, received):
        config = AuditConfig(path=str(path), include_prompts=True, otlp=True,
                             otlp_endpoint=f"{endpoint}/v1/logs",
                             otlp_batch_delay=0.05)  # fmt: skip
        log = AuditLog(config)
        await log.start()
        export = log.export
        assert export is not None
        try:
            for i in range(total):
                log.record({**entry(i), "_prompt": f"{i:02d}" + "p" * 64 * 1024})
            await log.flush()
            await wait_until(lambda: export.exported + export.dropped_failed >= total, 30)
        finally:
            await log.aclose()
    assert export.dropped_failed == 0 and export.exported == total
    hashes = {json.loads(line)["hash"] for line in path.read_text().splitlines()}
    assert {r["attributes"]["quicedge.audit.hash"] for r in log_records(received)} == hashes
    assert all(len(body) <= 1024 * 1024 for _, body in received)


async def test_what_waits_for_export_is_bounded_in_bytes_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`otlp_queue_size` counts records; with `include_prompts` each is as long as its prompt
    (8 MiB bodies: 2,048 of them held 16 GiB for a silent collector). Past `QUEUE_BYTES` of
    lines waiting, a new one is dropped as `queue_full`. Scaled down here: 2 MiB, 256 KiB."""
    monkeypatch.setattr(audit_export_module, "QUEUE_BYTES", 2 * 1024 * 1024, raising=False)
    path = tmp_path / "audit.jsonl"
    total = 20
    with dead_collector("silent") as endpoint:
        config = AuditConfig(path=str(path), include_prompts=True, otlp=True,
                             otlp_endpoint=endpoint, otlp_batch_delay=0.05,
                             otlp_timeout=30.0)  # fmt: skip
        log = AuditLog(config)
        await log.start()
        export = log.export
        assert export is not None
        try:
            for i in range(total):
                log.record({**entry(i), "_prompt": "p" * 256 * 1024})
            await log.flush()
            assert log.written == total
            assert export.depth <= 8 and export.dropped_full >= total - 8
            await asyncio.wait_for(asyncio.to_thread(export.close, 0.2), 20)
        finally:
            await log.aclose()
    assert export.dropped_full + export.dropped_failed == total
