"""The send timeout on hypercorn's connections (the TLS listener, HTTP/2 and HTTP/1.1).

hypercorn waits without a bound when a client stops taking a response: its per-connection
server awaits the socket's drain after each write (`TCPServer.protocol_send`), and over HTTP/2 a
stream's send buffer waits for the client's flow-control window (`StreamBuffer.push`, and
`drain` before the stream's end). A client that never reads, or never opens its window, would
hold the request, and the backend's answer behind it, for ever. `SendTimeout`, set on the
listener's hypercorn config, bounds both: `caps._GatedTCPServer.protocol_send` closes the
connection, `hypercorn_h2.GuardedH2Protocol.stream_send` resets the stream, and the app gets
`http.disconnect` either way. Only a write that would wait is timed: the usual write sets no
timer. Our own listeners keep the same bound in their connection timer (`h1_protocol`) and in
their stream's wait for acknowledgements (`h3_protocol`).

That wait on HTTP/2 is `BoundedStreamBuffer`'s: hypercorn's `StreamBuffer` let its writer go
whenever its sender took less than 16 KiB, which it does each time it finds the client's window
shut (it takes nothing), so an app's sends never waited there: a client that granted no credit
had every byte of a streamed answer buffered (8 streams: 54 MB in a minute), the proxy read its
backend at full speed, and no send timeout ever ran. The writer now goes once the buffer itself
is under the low-water mark.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import hypercorn.protocol.h2
from hypercorn.protocol.h2 import BUFFER_HIGH_WATER, BUFFER_LOW_WATER, StreamBuffer

SEND_TIMEOUT_ATTRIBUTE = "quicedge_send_timeout"
"""The hypercorn `Config` attribute that holds a listener's `SendTimeout`."""


@dataclass(frozen=True, slots=True)
class SendTimeout:
    seconds: float
    """How long a write may wait for the client to take some of the response."""
    on_timeout: Callable[[str], None] | None = None
    """The listener's count of cut-off requests, called with `send`."""

    def stalled(self) -> None:
        if self.on_timeout is not None:
            self.on_timeout("send")


def send_timeout_of(config: Any) -> SendTimeout | None:
    """The `SendTimeout` set on a hypercorn config (None: writes wait as hypercorn's do)."""
    return getattr(config, SEND_TIMEOUT_ATTRIBUTE, None)


class BoundedStreamBuffer(StreamBuffer):
    """hypercorn's HTTP/2 stream send buffer, whose writer waits while the buffer holds more
    than its high-water mark (32 KiB), until the client's credit takes it under the low one
    (16 KiB). hypercorn's let the writer go on a small take, and its sender takes nothing (a
    take of 0 bytes) each time it finds the window shut."""

    async def push(self, data: bytes) -> None:
        if self._complete:
            raise hypercorn.protocol.h2.BufferCompleteError()
        self.buffer.extend(data)
        await self._is_empty.clear()
        if len(self.buffer) >= BUFFER_HIGH_WATER:
            await self._paused.clear()  # set by a take that left the buffer low, since
            await self._paused.wait()

    async def pop(self, max_length: int) -> bytes:
        length = min(len(self.buffer), max_length)
        data = bytes(self.buffer[:length])
        del self.buffer[:length]
        if len(self.buffer) < BUFFER_LOW_WATER:
            await self._paused.set()
        if not self.buffer:
            await self._is_empty.set()
        return data


def install() -> None:
    """Have hypercorn's HTTP/2 streams buffer through `BoundedStreamBuffer` (idempotent):
    its protocol makes each stream's buffer from this name when the stream opens."""
    hypercorn.protocol.h2.StreamBuffer = BoundedStreamBuffer  # type: ignore[misc]


__all__ = [
    "SEND_TIMEOUT_ATTRIBUTE",
    "BoundedStreamBuffer",
    "SendTimeout",
    "install",
    "send_timeout_of",
]
