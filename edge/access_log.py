"""The access log: one JSON line per request on the `quicedge.access` logger.

Each line says who asked what, where it went and how it went: the request id (the client's
label), tenant (when admission knows one), route, model, backend, transport, whether it came in
0-RTT, status, TTFT, token counts, retries and duration. On by default at INFO, every request;
`sample_rate` keeps a share of the successes, and errors are always kept unless
`always_log_errors` is off. What the client chose is cut, so that no client makes its lines
long: the method to `METHOD_MAX` characters, the model to `MODEL_MAX`, an error to `ERROR_MAX`.

The request's task only builds the line (one `orjson.dumps`) and appends the text to a deque; a
writer thread hands the lines to the logger's handlers, which therefore run off the event loop:
a slow terminal or disk never stalls a request. Even `logging`'s own record-making stays off the
loop (through `logging.Logger.info` and a `QueueHandler` the line cost ~10x more). The writer
wakes for the first line after a quiet spell, gathers lines for `WRITE_INTERVAL`, and writes
them together; with only the default stderr handler, in one write. A thread that took each line
on its own, as a record and a write of its own, took the GIL from the event loop once per
request: about 0.25 ms on the edge's added TTFT p50 at 32 streams (docs/benchmarks.md,
"Edge-added latency"). Lines go to stderr unless the caller hands in its own handler, and a
handler added to the `quicedge.access` logger gets one record per line. The logger does not
propagate: access lines stay out of the application log. A reload that changes `[access_log]`
starts a new log before the old one writes what it holds, both on that logger meanwhile: each
writes to its own handler and the ones added to the logger, never to the other's, so that a
line is written once. At most `max_pending` lines wait for
the writer (a stalled stderr); past that a line is dropped and counted, and a handler that fails
is logged without ending the writer.
"""

from __future__ import annotations

import logging
import random
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from edge import settings
from edge.exchange import Exchange
from edge.tracing import ATTRIBUTE_MAX, cut

LOGGER = "quicedge.access"
_log = logging.getLogger(__name__)
WRITE_INTERVAL = 0.05
"""Seconds the writer gathers lines for before it writes them (at most this late on screen)."""
STOP_TIMEOUT = 5.0
"""Seconds `stop` waits for the writer to write what is left (a stalled stderr never ends)."""
ERROR_MAX = 512
"""Characters of an error message a line keeps. A message may quote what the client sent (an
unknown model, a path), which only the body limit bounds: without this a client could make each
of its requests write megabytes of log."""
METHOD_MAX = 32
"""Characters of the request's method a line keeps: the client's word, which only the header
limit bounds (no method in use is half as long)."""
_OWN_HANDLERS: weakref.WeakSet[logging.Handler] = weakref.WeakSet()
"""Every `AccessLog`'s own handler: a writer passes over another log's (`_Writer._handlers`)."""
MODEL_MAX = ATTRIBUTE_MAX
"""Characters of the request's `model` a line keeps (256, as its span's `gen_ai.request.model`):
`/generate` serves any name, which only the body limit bounds."""


@dataclass(slots=True)
class AccessLogConfig:
    """The access log (`[access_log]`)."""

    enabled: bool = True
    """Write one JSON line per request on the `quicedge.access` logger (INFO)."""
    sample_rate: float = 1.0
    """Share of successful requests logged, 0..1 (1: every one)."""
    always_log_errors: bool = True
    """Log every request answered with 4xx/5xx (or left by its client) whatever the sample rate."""
    max_pending: int = 100_000
    """Lines waiting for the writer at most (a stalled stderr); past it a line is dropped and
    counted in `quicedge_access_log_dropped_total`."""

    def validate(self) -> None:
        if not 0.0 <= self.sample_rate <= 1.0:
            raise ValueError(f"access_log.sample_rate: must be in 0..1, got {self.sample_rate}")
        if self.max_pending < 1:
            raise ValueError(f"access_log.max_pending: must be >= 1, got {self.max_pending}")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> AccessLogConfig:
        return settings.from_mapping(cls, values, "access_log")


class AccessLog:
    """Builds each request's line and hands it to the writer thread."""

    def __init__(self, config: AccessLogConfig, handler: logging.Handler | None = None) -> None:
        self.config = config
        self._random = random.random
        self._lines: deque[str] = deque()
        self.logger = logging.getLogger(LOGGER)
        self.logger.setLevel(logging.INFO)
        self.logger.propagate = False
        plain: logging.StreamHandler[Any] | None = None
        if handler is None:
            handler = plain = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("%(message)s"))
        self._handler = handler
        _OWN_HANDLERS.add(handler)
        self._plain = plain
        self._writer: _Writer | None = None
        """The running writer: set between `start` and `stop`."""
        self.dropped = 0
        """Lines dropped because `max_pending` lines were waiting."""

    def start(self) -> None:
        if self._writer is None:
            self.logger.addHandler(self._handler)
            self._writer = _Writer(self._lines, self.logger, self._handler, self._plain)
            self._writer.start()

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """Write what is queued, then stop the thread; after `timeout` seconds stop waiting
        (the thread is a daemon: a handler stuck for good does not keep the process alive)."""
        if self._writer is not None:
            self._writer.stop(timeout)
            self._writer = None
            self.logger.removeHandler(self._handler)

    @property
    def pending(self) -> int:
        """Lines waiting for the writer."""
        return len(self._lines)

    def wanted(self, status: int) -> bool:
        if status >= 400 and self.config.always_log_errors:
            return True
        rate = self.config.sample_rate
        return rate >= 1.0 or self._random() < rate

    def request(
        self,
        ex: Exchange | None,
        *,
        route: str,
        method: str,
        status: int,
        t_end: float,
        t0: float,
        error: str | None = None,
        request_id: str | None = None,
    ) -> None:
        """Log one request (`ex` is None when it failed before its state existed, or is not an
        inference request: `request_id` then names the id its answer carried)."""
        if not self.wanted(status):
            return
        if len(self._lines) >= self.config.max_pending:
            self.dropped += 1
            return
        line: dict[str, Any] = {
            "ts": round(time.time(), 3),
            "method": cut(method, METHOD_MAX),
            "route": route,
            "status": status,
            "duration_ms": round((t_end - t0) * 1000, 3),
        }
        if ex is not None:
            usage = ex.usage
            line.update(
                request_id=ex.request_id,
                tenant=getattr(ex, "tenant", None),
                model=_model(ex),
                backend=ex.backend.name if ex.backend is not None else None,
                transport=ex.transport,
                early_data=ex.early_data,
                stream=ex.stream,
                ttft_ms=round(ex.ttft * 1000, 3) if ex.ttft is not None else None,
                prompt_tokens=usage.prompt_tokens if usage is not None else None,
                cached_tokens=usage.cached_tokens if usage is not None else None,
                completion_tokens=usage.completion_tokens if usage is not None else None,
                retries=ex.retries,
            )
        elif request_id is not None:
            line["request_id"] = request_id
        if error is not None:
            line["error"] = cut(error, ERROR_MAX)
        writer = self._writer
        if writer is not None:
            self._lines.append(orjson.dumps(line).decode())
            if not writer.woken.is_set():
                writer.woken.set()


def _model(ex: Exchange) -> str | None:
    model = ex.view.model if ex.view is not None else None
    return cut(model, MODEL_MAX) if isinstance(model, str) else None


class _Writer(threading.Thread):
    """The thread that turns the lines into `quicedge.access` records and logs them."""

    def __init__(
        self,
        lines: deque[str],
        logger: logging.Logger,
        own: logging.Handler,
        plain: logging.StreamHandler[Any] | None,
    ) -> None:
        super().__init__(name="quicedge-access-log", daemon=True)
        self._lines = lines
        self._logger = logger
        self._own = own
        self._plain = plain
        self.woken = threading.Event()
        """Set by the first line after the writer last emptied the deque (and by `stop`)."""
        self._stopping = False

    def run(self) -> None:
        while True:
            self.woken.wait()
            if not self._stopping:
                time.sleep(WRITE_INTERVAL)  # let the lines of this interval gather
            # Cleared before the deque is emptied: a line appended after the last pop sets it
            # again, so none waits for a line after it. `stop` is read after the clear: a
            # `stop` that comes later sets `woken` again and gets one more round.
            self.woken.clear()
            stopping = self._stopping
            try:
                self._write_all()
            except Exception:  # a broken handler must not end the writer: later lines still go
                _log.exception("access log: a handler failed; the lines of that batch are lost")
            if stopping:
                return

    def _write_all(self) -> None:
        lines, logger = self._lines, self._logger
        batch: list[str] = []
        while lines:
            batch.append(lines.popleft())
        if not batch:
            return
        plain = self._plain
        handlers = self._handlers()
        if plain is not None and handlers == [plain]:
            # Only the default handler: what it would write, in one write. Each line's own
            # record and write took the GIL from the event loop once per request.
            plain.acquire()
            try:
                plain.stream.write("\n".join(batch) + "\n")
                plain.stream.flush()
            finally:
                plain.release()
            return
        for text in batch:  # `Logger.handle`, but past another log's handler
            record = logger.makeRecord(LOGGER, logging.INFO, __file__, 0, text, (), None)
            if logger.disabled or not logger.filter(record):
                continue
            for handler in handlers:
                if record.levelno >= handler.level:
                    handler.handle(record)

    def _handlers(self) -> list[logging.Handler]:
        """The logger's handlers this writer writes to: its own log's and those added to the
        logger, not another log's (the old or the new one of a reload, running beside it)."""
        own = self._own
        return [h for h in self._logger.handlers if h is own or h not in _OWN_HANDLERS]

    def stop(self, timeout: float) -> None:
        """Write every line appended before this call, then end the thread (waiting at most
        `timeout` seconds; a writer still stuck then is logged and left)."""
        self._stopping = True
        self.woken.set()
        self.join(timeout)
        if self.is_alive():
            _log.warning("access log: the writer is stuck in a handler; %d lines unwritten",
                         len(self._lines))  # fmt: skip


__all__ = ["ERROR_MAX", "LOGGER", "METHOD_MAX", "MODEL_MAX", "AccessLog", "AccessLogConfig"]
