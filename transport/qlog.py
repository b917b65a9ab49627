"""qlog traces of the listener's QUIC connections, for debugging (`--qlog-dir DIR`).

A qlog file (the IETF's JSON event log for QUIC and HTTP/3) shows what a connection did, packet
by packet: the handshake's flights, 0-RTT accepted or not, losses, the congestion window, the
pacer's holds, the HTTP/3 frames. Tools such as qvis draw it. aioquic records the events; this
module bounds them and writes them where the event loop does not wait:

- **One file per connection**, `DIR/<original destination connection ID>.qlog`, written when
  the connection ends.
- **Events per connection are bounded** (`max_events`, 20,000 by default: a handshake and a
  few hundred tokens). A longer connection keeps its first events, which is where handshake and
  first-token questions are answered, and its trace says how many it left out
  (`common_fields.quicedge_events_dropped`).
- **Writes happen on one thread of their own**, never on the event loop; at most
  `max_pending` traces wait for it (16 by default), and past that a trace is dropped rather
  than held in memory. `quicedge_qlog_traces_total{outcome}` counts `written`, `dropped`
  (too many waiting) and `failed` (the write raised: a full disk, a directory removed).

Off by default: with no directory, aioquic checks one attribute per event and records nothing.
On, a connection costs its events' dictionaries in memory until it ends and their JSON
encoding in the writer thread, which holds the GIL while it encodes: use it to debug, not at
full load.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from aioquic.quic.logger import QLOG_VERSION, QuicLogger, QuicLoggerTrace

log = logging.getLogger("quicedge.transport.qlog")

MAX_EVENTS = 20_000
"""Events kept per connection, by default."""
MAX_PENDING = 16
"""Ended traces that may wait for the writer thread, by default."""
SECRET_HEADERS = frozenset(
    {"authorization", "proxy-authorization", "cookie", "set-cookie", "x-api-key", "api-key"}
)
"""Headers whose values a trace does not keep (`HIDDEN` in their place)."""
HIDDEN = "***"

Outcome = Callable[[str], None]
"""Told `written`, `dropped` or `failed` for each trace that ends."""


def check_directory(path: str) -> Path:
    """`path` as a directory this process can write qlog files into; ValueError naming what is
    wrong."""
    directory = Path(path)
    if not directory.is_dir():
        raise ValueError(f"qlog directory {path!r} does not exist or is not a directory")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ValueError(f"qlog directory {path!r} is not writable")
    return directory


class BoundedTrace(QuicLoggerTrace):
    """aioquic's trace of one connection, keeping its first `max_events` events."""

    def __init__(self, *, is_client: bool, odcid: bytes, max_events: int) -> None:
        super().__init__(is_client=is_client, odcid=odcid)
        self.odcid = odcid
        self.max_events = max_events
        self.dropped = 0
        """Events left out past `max_events`."""

    def log_event(self, *, category: str, event: str, data: dict[str, Any]) -> None:
        if len(self._events) >= self.max_events:
            self.dropped += 1
            return
        super().log_event(category=category, event=event, data=data)

    def _encode_http3_headers(self, headers: Any) -> list[dict[str, Any]]:
        """aioquic's record of a HEADERS frame, with credentials' values masked: a trace is a
        file on disk, and `authorization` would put every client's API key there."""
        encoded: list[dict[str, Any]] = super()._encode_http3_headers(headers)
        for entry in encoded:
            if entry["name"].lower() in SECRET_HEADERS:
                entry["value"] = HIDDEN
        return encoded

    def to_dict(self) -> dict[str, Any]:
        trace = super().to_dict()
        trace["common_fields"]["quicedge_events_dropped"] = self.dropped
        return trace


class QlogWriter(QuicLogger):
    """A QuicLogger for `QuicConfiguration.quic_logger`: bounded traces, each written to its
    own file by a thread of its own."""

    def __init__(
        self,
        directory: Path,
        *,
        max_events: int = MAX_EVENTS,
        max_pending: int = MAX_PENDING,
        outcome: Outcome | None = None,
        write: Callable[[Path, dict[str, Any]], None] | None = None,
    ) -> None:
        if max_events < 1 or max_pending < 1:
            raise ValueError("qlog max_events and max_pending must be >= 1")
        super().__init__()
        self.directory = directory
        self.max_events = max_events
        self.max_pending = max_pending
        self._outcome = outcome or (lambda _outcome: None)
        self._write = write or _write_json
        self._pending = 0
        self._lock = threading.Lock()  # the loop adds to `_pending`, the writer thread takes
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="qlog")

    def start_trace(self, is_client: bool, odcid: bytes) -> QuicLoggerTrace:
        # Not kept in aioquic's list of traces: the connection holds its own until it ends.
        return BoundedTrace(is_client=is_client, odcid=odcid, max_events=self.max_events)

    def end_trace(self, trace: QuicLoggerTrace) -> None:
        with self._lock:
            full = self._pending >= self.max_pending
            if not full:
                self._pending += 1
        if full:
            self._outcome("dropped")
            return
        document: dict[str, Any] = {
            "qlog_format": "JSON",
            "qlog_version": QLOG_VERSION,
            "traces": [trace.to_dict()],  # the events list is copied here, on the loop
        }
        odcid = trace.odcid if isinstance(trace, BoundedTrace) else os.urandom(8)
        path = self.directory / f"{odcid.hex()}.qlog"
        try:
            future = self._executor.submit(self._write, path, document)
        except RuntimeError:  # closed: the listener is shutting down
            with self._lock:
                self._pending -= 1
            self._outcome("dropped")
            return
        future.add_done_callback(self._written)

    def _written(self, future: Future[None]) -> None:
        """In the writer thread, once a trace is written or has failed."""
        with self._lock:
            self._pending -= 1
        error = future.exception()
        if error is None:
            self._outcome("written")
            return
        log.warning("qlog trace not written: %s", error)
        self._outcome("failed")

    def close(self) -> None:
        """Take no more traces; those waiting are still written (at most `max_pending`, before
        the process exits)."""
        self._executor.shutdown(wait=False)


def _write_json(path: Path, document: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(document, handle, separators=(",", ":"))
