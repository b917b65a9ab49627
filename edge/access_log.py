"""The access log: one JSON line per request on the `quicedge.access` logger.

Each line says who asked what, where it went and how it went: the request id (the client's
label), tenant (when admission knows one), route, model, backend, transport, whether it came in
0-RTT, status, TTFT, token counts, retries and duration. On by default at INFO, every request;
`sample_rate` keeps a share of the successes, and errors are always kept unless
`always_log_errors` is off.

The request's task only builds the line (one `orjson.dumps`) and puts the text on a queue; a
`logging.handlers.QueueListener` thread makes the log record and hands it to the logger, whose
handlers therefore run off the event loop: a slow terminal or disk never stalls a request. Even
`logging`'s own record-making stays off the loop (through `logging.Logger.info` and a
`QueueHandler` the line cost ~10x more). Lines go to stderr unless the caller hands in its own
handler. The logger does not propagate: access lines stay out of the application log.
"""

from __future__ import annotations

import logging
import logging.handlers
import queue
import random
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from edge import settings
from edge.exchange import Exchange

LOGGER = "quicedge.access"


@dataclass(slots=True)
class AccessLogConfig:
    """The access log (`[access_log]`)."""

    enabled: bool = True
    """Write one JSON line per request on the `quicedge.access` logger (INFO)."""
    sample_rate: float = 1.0
    """Share of successful requests logged, 0..1 (1: every one)."""
    always_log_errors: bool = True
    """Log every request answered with 4xx/5xx (or left by its client) whatever the sample rate."""

    def validate(self) -> None:
        if not 0.0 <= self.sample_rate <= 1.0:
            raise ValueError(f"access_log.sample_rate: must be in 0..1, got {self.sample_rate}")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> AccessLogConfig:
        return settings.from_mapping(cls, values, "access_log")


class AccessLog:
    """Builds each request's line and hands it to the writer thread."""

    def __init__(self, config: AccessLogConfig, handler: logging.Handler | None = None) -> None:
        self.config = config
        self._random = random.random
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._put = self._queue.put_nowait
        self.logger = logging.getLogger(LOGGER)
        self.logger.setLevel(logging.INFO)
        self.logger.propagate = False
        if handler is None:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("%(message)s"))
        self._handler = handler
        self._listener = _Writer(self._queue, self.logger)
        self._started = False

    def start(self) -> None:
        if not self._started:
            self.logger.addHandler(self._handler)
            self._listener.start()
            self._started = True

    def stop(self) -> None:
        """Write what is queued, then stop the thread."""
        if self._started:
            self._listener.stop()
            self.logger.removeHandler(self._handler)
            self._started = False

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
    ) -> None:
        """Log one request (`ex` is None when it failed before its state existed)."""
        if not self.wanted(status):
            return
        line: dict[str, Any] = {
            "ts": round(time.time(), 3),
            "method": method,
            "route": route,
            "status": status,
            "duration_ms": round((t_end - t0) * 1000, 3),
        }
        if ex is not None:
            usage = ex.usage
            line.update(
                request_id=ex.request_id,
                tenant=getattr(ex, "tenant", None),
                model=ex.view.model if ex.view is not None else None,
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
        if error is not None:
            line["error"] = error
        if self._started:
            self._put(orjson.dumps(line).decode())


class _Writer(logging.handlers.QueueListener):
    """The thread that turns queued lines into `quicedge.access` records and logs them."""

    def __init__(self, lines: queue.SimpleQueue[Any], logger: logging.Logger) -> None:
        super().__init__(lines)
        self._logger = logger

    def handle(self, record: Any) -> None:
        if isinstance(record, str):
            record = self._logger.makeRecord(LOGGER, logging.INFO, __file__, 0, record, (), None)
        self._logger.handle(record)


__all__ = ["LOGGER", "AccessLog", "AccessLogConfig"]
