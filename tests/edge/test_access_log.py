"""The access log: one JSON line per request, written by a thread off the event loop, sampled
as configured with errors always kept; on by default in `quicedge serve`."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import logging.handlers
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from backends.sim import SimConfig, SimServer
from edge.access_log import (
    ERROR_MAX,
    LOGGER,
    METHOD_MAX,
    MODEL_MAX,
    AccessLog,
    AccessLogConfig,
)
from edge.config import SECTIONS
from edge.telemetry import AccessLogCollector
from edge.tracing import ATTRIBUTE_MAX
from edge.wiring import build
from tests.edge.conftest import fast_config, hypercorn_app
from tests.helpers import wait_until

CHAT = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[dict[str, Any]] = []
        self.threads: set[str] = set()

    def emit(self, record: logging.LogRecord) -> None:
        import threading

        self.threads.add(threading.current_thread().name)
        self.lines.append(json.loads(record.getMessage()))


@contextlib.asynccontextmanager
async def logged_edge(config: AccessLogConfig) -> AsyncIterator[tuple[str, Lines]]:
    async with SimServer(SimConfig(name="s", port=0, profile="instant")) as sim:
        wiring = await build(fast_config([sim.url]), registry=CollectorRegistry(),
                             access_log=config)  # fmt: skip
        assert wiring.access_log is not None
        lines = Lines()
        wiring.access_log = AccessLog(config, handler=lines)  # capture what it writes
        wiring.app.access_log = wiring.access_log  # type: ignore[attr-defined]
        await wiring.start()
        try:
            async with hypercorn_app(wiring.app) as url:
                yield url, lines
        finally:
            await wiring.aclose()


async def test_one_json_line_per_request() -> None:
    async with logged_edge(AccessLogConfig()) as (url, lines):
        async with httpx.AsyncClient(base_url=url) as http:
            streamed = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
            ok = await http.post(
                "/v1/chat/completions", json=streamed, headers={"x-request-id": "acc-1"}
            )
            bad = await http.post("/v1/chat/completions", json={"messages": []})
            missing = await http.get("/nope")
            await http.get("/v1/models")
        await wait_until(lambda: len(lines.lines) == 4)
    assert ok.status_code == 200 and bad.status_code == 400 and missing.status_code == 404
    first, second, third, fourth = lines.lines
    assert first["request_id"] == "acc-1"
    assert first["status"] == 200 and first["route"] == "/v1/chat/completions"
    assert first["model"] == "default" and first["backend"] and first["transport"] == "h1"
    assert first["early_data"] is False and first["stream"] is True
    assert first["ttft_ms"] > 0 and first["duration_ms"] >= first["ttft_ms"]
    assert first["completion_tokens"] == 3 and first["prompt_tokens"] > 0
    assert first["tenant"] == "anonymous"  # the admitted tenant: no API key here
    assert second["status"] == 400 and "messages" in second["error"]
    assert third == {**third, "status": 404, "route": "other", "method": "GET"}
    assert fourth["route"] == "/v1/models" and fourth["status"] == 200
    # written by the listener's thread, not the event loop's
    assert lines.threads and "MainThread" not in lines.threads


async def test_sampling_keeps_errors() -> None:
    async with logged_edge(AccessLogConfig(sample_rate=0.0)) as (url, lines):
        async with httpx.AsyncClient(base_url=url) as http:
            for _ in range(3):
                assert (await http.post("/v1/chat/completions", json=CHAT)).status_code == 200
            assert (await http.post("/v1/chat/completions", json={})).status_code == 400
        await wait_until(lambda: len(lines.lines) >= 1)
    assert [line["status"] for line in lines.lines] == [400]


async def test_a_client_cannot_make_a_line_long_or_break_it() -> None:
    """An error quoting what the client sent (an unknown model) is cut to `ERROR_MAX`; what the
    client sent with newlines or quotes stays inside its JSON string."""
    async with logged_edge(AccessLogConfig()) as (url, lines):
        async with httpx.AsyncClient(base_url=url) as http:
            huge = {**CHAT, "model": "M" * 200_000}
            assert (await http.post("/v1/chat/completions", json=huge)).status_code == 404
            forged = {**CHAT, "model": 'x"}\n{"status":200,"route":"/forged'}
            assert (await http.post("/v1/chat/completions", json=forged)).status_code == 404
        await wait_until(lambda: len(lines.lines) == 2)
    first, second = lines.lines
    assert first["status"] == 404 and first["error"].startswith("The model `MMM")
    assert len(first["error"]) == ERROR_MAX + len("...")
    assert second["status"] == 404 and '"/forged' in second["error"]


def test_on_by_default_and_checked() -> None:
    (section,) = [s for s in SECTIONS if s.name == "access_log"]
    defaults = section.kind()
    assert defaults.enabled and defaults.sample_rate == 1.0 and defaults.always_log_errors
    lines = Lines()
    log = AccessLog(AccessLogConfig(), handler=lines)
    log.start()
    try:
        assert lines in logging.getLogger(LOGGER).handlers
        assert log._writer is not None and log._writer.is_alive()
    finally:
        log.stop()  # writes what was queued first
    try:
        AccessLogConfig(sample_rate=1.5).validate()
    except ValueError as exc:
        assert "access_log.sample_rate" in str(exc)
    else:
        raise AssertionError("a sample rate above 1 was accepted")


def _log_many(log: AccessLog, first: int, count: int) -> None:
    for i in range(first, first + count):
        log.request(None, route=f"/r{i}", method="GET", status=200, t_end=1.0, t0=0.0)


def test_every_line_is_written_in_order_and_stop_flushes_the_rest() -> None:
    """A burst is written in order off the caller's thread; lines appended just before `stop`
    are written by it, and a stopped log starts again."""
    lines = Lines()
    log = AccessLog(AccessLogConfig(), handler=lines)
    log.start()
    try:
        _log_many(log, 0, 5000)
    finally:
        log.stop()
    assert [line["route"] for line in lines.lines] == [f"/r{i}" for i in range(5000)]
    assert lines.threads == {"quicedge-access-log"}
    log.start()
    try:
        _log_many(log, 5000, 1)
    finally:
        log.stop()
    assert lines.lines[-1]["route"] == "/r5000"


async def test_a_line_after_a_quiet_spell_is_written_within_the_interval() -> None:
    lines = Lines()
    log = AccessLog(AccessLogConfig(), handler=lines)

    def written(count: int) -> Callable[[], bool]:
        return lambda: len(lines.lines) == count

    log.start()
    try:
        for n in range(1, 4):
            _log_many(log, n, 1)
            await wait_until(written(n), timeout=2)
    finally:
        log.stop()


def test_the_default_handler_gets_each_line_on_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """With only its own stderr handler, the writer writes a batch in one go: the same text as
    one record per line would give."""
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    log = AccessLog(AccessLogConfig())
    log.start()
    try:
        _log_many(log, 0, 300)
    finally:
        log.stop()
    written = err.getvalue().splitlines()
    assert [json.loads(line)["route"] for line in written] == [f"/r{i}" for i in range(300)]
    assert err.getvalue().endswith("}\n")


class Stalled(logging.Handler):
    """A handler whose writes block until released, as a stderr nobody reads."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.unblock = threading.Event()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.entered.set()
        self.unblock.wait(10)
        self.lines.append(record.getMessage())


def test_a_stalled_handler_bounds_the_waiting_lines_and_counts_the_rest() -> None:
    handler = Stalled()
    log = AccessLog(AccessLogConfig(max_pending=10), handler=handler)
    registry = CollectorRegistry()
    registry.register(AccessLogCollector(lambda: log))
    log.start()
    try:
        _log_many(log, 0, 1)
        assert handler.entered.wait(5)  # the writer is stuck in the first write
        _log_many(log, 1, 25)
        assert registry.get_sample_value("quicedge_access_log_pending") == 10
        assert registry.get_sample_value("quicedge_access_log_dropped_total") == 15
    finally:
        handler.unblock.set()
        log.stop()
    routes = [json.loads(line)["route"] for line in handler.lines]
    assert routes == [f"/r{i}" for i in range(11)]  # the first, then the ten that waited
    assert registry.get_sample_value("quicedge_access_log_pending") == 0


def test_max_pending_must_be_positive() -> None:
    with pytest.raises(ValueError, match="access_log.max_pending"):
        AccessLogConfig(max_pending=0).validate()


class BreaksOnce(Lines):
    """A handler that fails outside `emit` once (where `logging` does not catch it)."""

    def __init__(self) -> None:
        super().__init__()
        self.broken = True

    def handle(self, record: logging.LogRecord) -> bool:
        if self.broken:
            self.broken = False
            raise RuntimeError("handler broke")
        return super().handle(record)


async def test_a_failing_handler_does_not_end_the_writer(caplog: pytest.LogCaptureFixture) -> None:
    handler = BreaksOnce()
    log = AccessLog(AccessLogConfig(), handler=handler)
    log.start()
    try:
        _log_many(log, 0, 1)
        await wait_until(lambda: not handler.broken, timeout=2)
        _log_many(log, 1, 1)
        await wait_until(lambda: len(handler.lines) == 1, timeout=2)
    finally:
        log.stop()
    assert handler.lines[0]["route"] == "/r1"
    assert "a handler failed" in caplog.text


def test_stop_gives_up_on_a_handler_stuck_for_good(caplog: pytest.LogCaptureFixture) -> None:
    handler = Stalled()
    log = AccessLog(AccessLogConfig(), handler=handler)
    log.start()
    _log_many(log, 0, 1)
    assert handler.entered.wait(5)
    _log_many(log, 1, 3)
    writer = log._writer
    assert writer is not None
    started = time.monotonic()
    log.stop(timeout=0.2)
    assert time.monotonic() - started < 2
    assert "the writer is stuck in a handler; 3 lines unwritten" in caplog.text
    handler.unblock.set()  # let the daemon thread end: its three lines go to the logger's
    writer.join(5)  # handlers, which must not be the next test's
    assert not writer.is_alive()


async def test_a_client_chosen_model_name_is_cut_in_the_line() -> None:
    """`/generate` serves any model name, so only the body limit bounds the `model` a line
    would carry: it keeps `MODEL_MAX` characters, as the span's `gen_ai.request.model`."""
    async with logged_edge(AccessLogConfig()) as (url, lines):
        async with httpx.AsyncClient(base_url=url) as http:
            body = {"text": "hi", "model": "M" * 100_000, "sampling_params": {"max_new_tokens": 2}}
            assert (await http.post("/generate", json=body)).status_code == 200
            short = {**body, "model": "m" * MODEL_MAX}
            assert (await http.post("/generate", json=short)).status_code == 200
        await wait_until(lambda: len(lines.lines) == 2)
    first, second = lines.lines
    assert first["model"] == "M" * MODEL_MAX + "..."
    assert second["model"] == "m" * MODEL_MAX
    assert MODEL_MAX == ATTRIBUTE_MAX


async def test_a_client_chosen_method_is_cut_in_the_line() -> None:
    """The request line's method is the client's word, which only the header limit bounds
    (kilobytes): a line keeps `METHOD_MAX` characters of it."""
    async with logged_edge(AccessLogConfig()) as (url, lines):
        host, port = url.split("//")[1].rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write(b"X" * 12_000 + b" /v1/completions HTTP/1.1\r\nhost: x\r\n"
                         b"content-length: 0\r\n\r\n")  # fmt: skip
            await writer.drain()
            assert (await reader.readuntil(b"\r\n")).startswith(b"HTTP/1.1 405")
        finally:
            writer.close()
        await wait_until(lambda: len(lines.lines) == 1)
    (line,) = lines.lines
    assert line["method"] == "X" * METHOD_MAX + "..."
    assert line["status"] == 405 and len(line["error"]) == ERROR_MAX + len("...")
