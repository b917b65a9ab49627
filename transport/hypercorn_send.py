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
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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


__all__ = ["SEND_TIMEOUT_ATTRIBUTE", "SendTimeout", "send_timeout_of"]
