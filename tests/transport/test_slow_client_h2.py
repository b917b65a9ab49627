"""An HTTP/2 client that keeps its flow-control window shut while its answer keeps coming.

hypercorn holds each stream's outgoing bytes in a buffer whose writer (the app's `send`) waits
past 32 KiB, until the client's credit takes the buffer down again. What the app hands over
while the window is shut must stay near that mark, so that the proxy stops reading its backend
(which then stops generating for nobody) and the send timeout, which times that wait, cuts the
stream off.
"""

from __future__ import annotations

import asyncio
from typing import Any

import h2.errors
import h2.events

from tests.transport.apps import RecordingApp
from tests.transport.test_deadlines_and_caps import h2_client, h2_get
from transport.tcp import TcpListener, TcpOptions
from transport.tls import TlsMaterial

CHUNK = 64 * 1024


class Stream:
    """Streams 64 KiB chunks until the client goes, up to 32 MiB, counting what `send` took."""

    def __init__(self) -> None:
        self.handed = 0
        self.gone = asyncio.Event()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            self.gone.set()

        watcher = asyncio.ensure_future(watch())
        try:
            await send({"type": "http.response.start", "status": 200, "headers": []})
            for _ in range(512):
                if self.gone.is_set():
                    return
                await send({"type": "http.response.body", "body": b"x" * CHUNK, "more_body": True})
                self.handed += CHUNK
                await asyncio.sleep(0)  # the watcher hears a disconnect the send did not raise
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await asyncio.sleep(0)
            watcher.cancel()


async def test_a_shut_window_holds_the_app_and_the_stream_is_reset(
    tls: TlsMaterial, dev_certs: Any
) -> None:
    app = Stream()
    timeouts: list[str] = []
    served = TcpListener(app, host="127.0.0.1", port=0, tls=tls,
                         options=TcpOptions(send_timeout=0.5),
                         on_timeout=timeouts.append)  # fmt: skip
    await served.start()
    conn, reader, writer = await h2_client(served.port, dev_certs.ca_cert)
    try:
        stream_id = h2_get(conn, "/stream")
        writer.write(conn.data_to_send())
        reset: h2.events.StreamReset | None = None
        received = 0
        async with asyncio.timeout(10):
            while reset is None:
                data = await reader.read(65536)
                assert data, "the connection closed; only the stream should have"
                for event in conn.receive_data(data):  # no acknowledge_received_data: no credit
                    if isinstance(event, h2.events.StreamReset):
                        reset = event
                    elif isinstance(event, h2.events.DataReceived):
                        received += len(event.data)
                writer.write(conn.data_to_send())
        assert reset.stream_id == stream_id and reset.error_code == h2.errors.ErrorCodes.CANCEL
        await asyncio.wait_for(app.gone.wait(), 5)
        assert timeouts == ["send"]
        # The client's window (64 KiB) went out; the buffer's mark (32 KiB) and the chunk that
        # crossed it wait. hypercorn let the app go on past the mark whenever the window
        # was shut, and it handed over all 32 MiB in a tight loop before the reset.
        assert received <= 65535
        assert app.handed <= received + 32 * 1024 + 2 * CHUNK
    finally:
        writer.close()
        await served.stop()


async def test_an_http2_body_without_content_length_that_trickles_in_gets_408(
    tls: TlsMaterial, dev_certs: Any
) -> None:
    """HTTP/2 frames a body without `content-length` (DATA until END_STREAM): such a body, a
    byte every 0.1 s, is cut off by the body deadline as one with a length is."""
    timeouts: list[str] = []
    served = TcpListener(RecordingApp(), host="127.0.0.1", port=0, tls=tls,
                         options=TcpOptions(body_timeout=0.6),
                         on_timeout=timeouts.append)  # fmt: skip
    await served.start()
    conn, reader, writer = await h2_client(served.port, dev_certs.ca_cert)
    try:
        stream_id = conn.get_next_available_stream_id()
        conn.send_headers(stream_id, [(":method", "POST"), (":scheme", "https"),
                                      (":authority", "localhost"), (":path", "/echo")])  # fmt: skip
        writer.write(conn.data_to_send())
        status: bytes | None = None
        async with asyncio.timeout(10):
            while status is None:
                try:
                    async with asyncio.timeout(0.1):
                        data = await reader.read(65536)
                except TimeoutError:
                    conn.send_data(stream_id, b"x")  # the next byte of a body that never ends
                    writer.write(conn.data_to_send())
                    continue
                assert data, "the connection closed; only the request should have ended"
                for event in conn.receive_data(data):
                    if isinstance(event, h2.events.ResponseReceived):
                        status = dict(event.headers)[b":status"]
                    assert not isinstance(event, h2.events.StreamReset)
                writer.write(conn.data_to_send())
        assert status == b"408"
        assert timeouts == ["body"]
    finally:
        writer.close()
        await served.stop()
