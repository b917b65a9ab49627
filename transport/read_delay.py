"""How long a byte waits on a socket before the event loop reads it.

The edge's per-request timings start at its socket reads (`arrived_at`, the pool's read
stamps). A request or a token that arrives while the loop is busy with other callbacks waits in
the kernel until the loop polls again, and no per-request clock can see that wait. Under bursts
(32 streams that end in the same step) it was most of what the edge added (docs/benchmarks.md,
"Fourth pass"). This probe samples it directly: a thread sends a byte, stamped with
`time.perf_counter()`, over a socket pair every `interval` (jittered, so that it does not lock
onto periodic work), and the loop's reader records how long the byte waited. The thread holds
the GIL only to stamp and send; the loop reads on its own schedule, as it reads any client.
"""

from __future__ import annotations

import asyncio
import random
import socket
import struct
import threading
import time
from typing import Protocol

_STAMP = struct.Struct("d")


class Observer(Protocol):
    def observe(self, value: float) -> None: ...


class ReadDelayProbe:
    """Samples the loop's read delay into `observer` until `stop()`."""

    def __init__(self, observer: Observer, *, interval: float = 0.1) -> None:
        if interval <= 0:
            raise ValueError("interval must be > 0")
        self._observer = observer
        self._interval = interval
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader, self._writer = socket.socketpair()
        self._reader.setblocking(False)
        self.samples = 0

    def start(self) -> None:
        """Start sampling on the running loop."""
        if self._thread is not None:
            raise RuntimeError("already started")
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._reader.fileno(), self._on_readable)
        self._thread = threading.Thread(target=self._send, name="read-delay-probe", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread and close the sockets (on the loop's thread); idempotent."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._loop is not None:
            self._loop.remove_reader(self._reader.fileno())
            self._loop = None
        self._reader.close()
        self._writer.close()

    def _send(self) -> None:
        while not self._stopping.wait(self._interval * random.uniform(0.5, 1.5)):
            try:
                self._writer.send(_STAMP.pack(time.perf_counter()))
            except OSError:
                return

    def _on_readable(self) -> None:
        now = time.perf_counter()
        try:
            data = self._reader.recv(_STAMP.size * 64)
        except (BlockingIOError, InterruptedError):
            return
        for (sent,) in _STAMP.iter_unpack(data):  # whole stamps: each is one small write
            self._observer.observe(max(0.0, now - sent))
            self.samples += 1
