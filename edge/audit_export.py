"""The audit log's records as OpenTelemetry log records, exported over OTLP/HTTP.

The file chain (`edge/audit.py`) is the record of truth; this is a copy for a log backend, and
it may lose records, never delay them: the audit writer's thread hands each written line to
`emit`, which only appends to the OpenTelemetry SDK's batch queue (`BatchLogRecordProcessor`),
whose own thread encodes and sends, a batch in parts under the exporter's request bound. At
most `queue_size` records, and `QUEUE_BYTES` of their lines, wait for export; past that a new
record is dropped and counted (`queue_full`), and a batch the collector does not accept
within the export timeout (retries included) is dropped and counted (`failed`). Each log record
carries its line's chain hash (`quicedge.audit.hash`, and `quicedge.audit.prev`), so an exported
record can be matched to its line and `quicedge audit verify` can vouch for it.

The body is the line as written in the file; the attributes repeat the fields a log backend
filters on, with the names the request's span uses (`quicedge.tenant`, `quicedge.policy.decision`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from opentelemetry._logs import LogRecord, SeverityNumber
from opentelemetry.sdk._logs import LoggerProvider, ReadableLogRecord
from opentelemetry.sdk._logs.export import (
    BatchLogRecordProcessor,
    LogRecordExporter,
    LogRecordExportResult,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from edge.tracing import check_otlp_protocol, service_resource

EVENT_NAME = "quicedge.audit"
"""The log records' event name: what a log backend selects audit records by."""

ATTRIBUTES: tuple[tuple[str, str], ...] = (
    ("quicedge.audit.hash", "hash"),
    ("quicedge.audit.prev", "prev"),
    ("quicedge.request_id", "request_id"),
    ("quicedge.tenant", "tenant"),
    ("quicedge.policy.decision", "decision"),
    ("quicedge.policy.rules", "rules"),
    ("http.route", "route"),
    ("http.response.status_code", "status"),
    ("gen_ai.request.model", "model"),
    ("quicedge.backend", "backend"),
    ("quicedge.transport", "transport"),
    ("quicedge.early_data", "early_data"),
)
"""(attribute, record field): what each log record carries besides its body. A field that is
null in the record is left out (OpenTelemetry attributes have no null)."""


REQUEST_MAX = 64 * 1024 * 1024
"""The exporter's bound on one request (its own default), where it does not say its own."""
QUEUE_BYTES = 128 * 1024 * 1024
"""Characters of lines waiting for export (or being exported), at most: past it a new record
is dropped as `queue_full`. With `include_prompts` a line is as long as its prompt, so
`queue_size` records alone could hold gigabytes while a collector is slow."""
RECORD_OVERHEAD = 4096
"""Bytes a log record is taken to add to its body (attributes, framing), at most."""


def otlp_exporter_class() -> Any:
    """The OTLP/HTTP log exporter (the `otlp` extra), or a one-line ValueError without it."""
    try:
        from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
    except ImportError:
        raise ValueError(
            "audit.otlp: needs the OTLP exporter: pip install 'quicedge[otlp]'"
        ) from None
    return OTLPLogExporter


def check_otlp(environ: Mapping[str, str] | None = None) -> None:
    """A one-line ValueError, at start, for an export this build cannot do: no `otlp` extra,
    or `OTEL_EXPORTER_OTLP_LOGS_PROTOCOL` / `OTEL_EXPORTER_OTLP_PROTOCOL` naming another
    protocol than http/protobuf (every record posted to a gRPC port would be lost)."""
    otlp_exporter_class()
    try:
        check_otlp_protocol(os.environ if environ is None else environ, "LOGS")
    except ValueError as exc:
        raise ValueError(f"audit.otlp: {exc}") from None


class _CountingExporter(LogRecordExporter):
    """Wraps the OTLP exporter to count what leaves the queue, is sent, or fails."""

    def __init__(self, inner: LogRecordExporter, owner: AuditExport) -> None:
        self._inner = inner
        self._owner = owner
        self._abandoned = False
        self._inner_closed = False
        self._close_lock = threading.Lock()

    def export(self, batch: Sequence[ReadableLogRecord]) -> LogRecordExportResult:
        """Send the batch in parts of at most half the exporter's request bound: with
        `include_prompts` a body is as long as its prompt, and a request over the bound is
        dropped whole by the exporter, every record in it. After a part fails, the rest are
        counted as failed at once (a dead collector costs one timeout, not one a part)."""
        owner = self._owner
        owner._taken(len(batch))
        ok = True
        for part, chars in self._parts(batch):
            if not ok or self._abandoned:
                owner._done(len(part), chars, ok=False)
                ok = False
                continue
            try:
                ok = self._inner.export(part) is LogRecordExportResult.SUCCESS
            except Exception:  # the SDK would log and drop it; it is counted here too
                ok = False
            owner._done(len(part), chars, ok=ok)
        return LogRecordExportResult.SUCCESS if ok else LogRecordExportResult.FAILURE

    def _parts(
        self, batch: Sequence[ReadableLogRecord]
    ) -> Iterator[tuple[Sequence[ReadableLogRecord], int]]:
        """(part, characters of its bodies): the batch cut where a request would pass half the
        exporter's bound (the rest is room for attributes and framing)."""
        bound = (getattr(self._inner, "_max_request_size", None) or REQUEST_MAX) // 2
        start = size = chars = 0
        for i, record in enumerate(batch):
            body = record.log_record.body
            text = body if isinstance(body, str) else ""
            length = (len(text) if text.isascii() else len(text.encode())) + RECORD_OVERHEAD
            if i > start and size + length > bound:
                yield batch[start:i], chars
                start, size, chars = i, 0, 0
            size += length
            chars += len(text)
        if start < len(batch):
            yield batch[start:], chars

    def abandon(self) -> None:
        """Stop retrying the export in progress and refuse the rest (the shutdown's grace ran
        out): what is still queued is counted as failed instead of holding the shutdown."""
        self._abandoned = True
        self._close_inner()

    def _close_inner(self) -> None:
        with self._close_lock:
            if not self._inner_closed:
                self._inner_closed = True
                self._inner.shutdown()

    def shutdown(self) -> None:
        self._close_inner()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True


class AuditExport:
    """One process's audit export: `emit` from the audit writer's thread, never blocking."""

    def __init__(
        self,
        *,
        endpoint: str | None,
        queue_size: int,
        batch_delay: float,
        timeout: float,
        exporter: LogRecordExporter | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.queue_size = queue_size
        self.batch_delay = batch_delay
        self.timeout = timeout
        self._exporter_override = exporter
        self._lock = threading.Lock()
        self._pending = 0
        """Records emitted and not yet taken by the exporter: the SDK queue's length, bounded
        here (with the batch in flight) so that the SDK's own full-queue drop, silent and of
        the oldest, never happens."""
        self._in_flight = 0
        """Records in the batch being exported."""
        self._chars = 0
        """Characters of the lines of the `depth` records (bounded by `QUEUE_BYTES`)."""
        self._closed = False
        self.exported = 0
        self.dropped_full = 0
        self.dropped_failed = 0
        self._provider: LoggerProvider | None = None
        self._counting: _CountingExporter | None = None
        self._logger: Any = None

    @property
    def depth(self) -> int:
        """Records waiting for export or being exported."""
        return self._pending + self._in_flight

    def start(self) -> None:
        """Build the provider and its export thread (once the process that serves exists)."""
        if self._provider is not None:
            return
        inner = self._exporter_override
        if inner is None:
            # The endpoint left open is the SDK's: OTEL_EXPORTER_OTLP_LOGS_ENDPOINT, else
            # OTEL_EXPORTER_OTLP_ENDPOINT + /v1/logs, the collector the spans go to.
            inner = otlp_exporter_class()(endpoint=self.endpoint, timeout=self.timeout)
        self._counting = _CountingExporter(inner, self)
        # The spans' resource: OTEL_SERVICE_NAME, else OTEL_RESOURCE_ATTRIBUTES' service.name,
        # else quicedge; the variables' other attributes too.
        provider = LoggerProvider(resource=service_resource(os.environ), shutdown_on_exit=False)
        provider.add_log_record_processor(
            BatchLogRecordProcessor(
                self._counting,
                schedule_delay_millis=self.batch_delay * 1000,
                max_export_batch_size=min(512, self.queue_size),
                max_queue_size=self.queue_size,
            )
        )
        self._provider = provider
        self._logger = provider.get_logger("quicedge.audit")

    def emit(self, record: Mapping[str, Any], line: str) -> bool:
        """Queue one written line for export; False when it was dropped (queue full)."""
        if self._logger is None:
            return False
        with self._lock:
            if (
                self._pending + self._in_flight >= self.queue_size
                or self._chars + len(line) > QUEUE_BYTES
            ):
                self.dropped_full += 1
                return False
            self._pending += 1
            self._chars += len(line)
        attributes: dict[str, Any] = {}
        for name, key in ATTRIBUTES:
            value = record.get(key)
            if value is not None:
                attributes[name] = value
        ts = record.get("ts")
        try:
            self._logger.emit(
                LogRecord(
                    timestamp=int(ts * 1e9) if isinstance(ts, int | float) else None,
                    severity_number=SeverityNumber.INFO,
                    severity_text="INFO",
                    body=line,
                    attributes=attributes,
                    event_name=EVENT_NAME,
                )
            )
        except Exception:
            with self._lock:
                self._pending -= 1
                self._chars -= len(line)
                self.dropped_failed += 1
            raise
        return True

    def close(self, grace: float) -> None:
        """Export what is queued for at most `grace` seconds, then stop (blocks: run it in a
        thread). What did not go out in time is counted as failed; an export still waiting on
        a silent collector is left to its own timeout in the SDK's (daemon) thread."""
        provider, counting = self._provider, self._counting
        if provider is None or counting is None:
            return
        self._provider = None
        self._logger = None
        stopped = threading.Event()

        def stop() -> None:
            try:
                provider.shutdown()
            finally:
                stopped.set()

        threading.Thread(target=stop, name="quicedge-audit-export-stop", daemon=True).start()
        if not stopped.wait(grace):
            counting.abandon()  # no more retries; the batches left fail at once
            stopped.wait(1.0)
        with self._lock:
            self._closed = True
            self.dropped_failed += self._pending + self._in_flight
            self._pending = self._in_flight = self._chars = 0

    # -- counts, from the SDK's export thread --------------------------------------------------

    def _taken(self, n: int) -> None:
        with self._lock:
            if not self._closed:
                self._pending -= n
                self._in_flight += n

    def _done(self, n: int, chars: int, ok: bool) -> None:
        with self._lock:
            if self._closed:
                return  # counted as failed when the close gave up on it
            self._in_flight -= n
            self._chars -= chars
            if ok:
                self.exported += n
            else:
                self.dropped_failed += n

    def collector(self) -> Collector:
        return _ExportCollector(self)


class _ExportCollector(Collector):
    """Read-at-scrape counts of the audit export."""

    def __init__(self, export: AuditExport) -> None:
        self._export = export

    def collect(self) -> Iterator[Metric]:
        depth = GaugeMetricFamily(
            "quicedge_audit_export_queue_depth",
            "Audit records waiting for export as OpenTelemetry log records",
        )
        depth.add_metric([], self._export.depth)
        exported = CounterMetricFamily(
            "quicedge_audit_exported",
            "Audit records the OTLP collector accepted as log records",
        )
        exported.add_metric([], self._export.exported)
        dropped = CounterMetricFamily(
            "quicedge_audit_export_dropped",
            "Audit records not exported (the file still has them): the export queue was full"
            " (queue_full) or the collector did not accept them in time (failed)",
            labels=["reason"],
        )
        dropped.add_metric(["queue_full"], self._export.dropped_full)
        dropped.add_metric(["failed"], self._export.dropped_failed)
        yield from (depth, exported, dropped)


__all__ = ["ATTRIBUTES", "EVENT_NAME", "AuditExport", "check_otlp", "otlp_exporter_class"]
