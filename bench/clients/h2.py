"""HTTP/2 client over TLS (the `h2` state machine on asyncio streams); streams multiplex on one
connection when connections are reused."""

from __future__ import annotations

import asyncio
import socket
import time

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.settings

from bench.clients.base import ClientOptions, StreamingClient, Target, tcp_ssl_context
from bench.stream import RequestResult, StreamParser, TextCallback

READ_SIZE = 65536
# A window large enough that flow control never paces a streamed answer (RFC 9113 §6.9.2).
WINDOW = 16 * 1024 * 1024


_FREES_A_STREAM = (
    h2.events.StreamEnded,
    h2.events.StreamReset,
    h2.events.RemoteSettingsChanged,
)


class _Connection:
    """One HTTP/2 connection: a reader task routes events to per-stream queues."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.h2 = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=True, header_encoding=None)
        )
        self.streams: dict[int, asyncio.Queue[h2.events.Event | None]] = {}
        self.closed = False
        self.window_opened = asyncio.Event()  # set when the peer grants more send window
        self.stream_freed = asyncio.Event()  # set when a stream closes or the limit changes
        self.h2.initiate_connection()
        self.h2.increment_flow_control_window(WINDOW)
        self.h2.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: WINDOW})
        self.flush()
        self.task = asyncio.create_task(self._read_loop())

    def flush(self) -> None:
        data = self.h2.data_to_send()
        if data:
            self.writer.write(data)

    async def _read_loop(self) -> None:
        try:
            while True:
                data = await self.reader.read(READ_SIZE)
                if not data:
                    break
                for event in self.h2.receive_data(data):
                    stream_id = getattr(event, "stream_id", None)
                    if isinstance(event, h2.events.DataReceived):
                        # Give the window back at once: the benchmark must not be flow-limited.
                        self.h2.acknowledge_received_data(
                            event.flow_controlled_length, event.stream_id
                        )
                    if isinstance(event, h2.events.WindowUpdated | h2.events.RemoteSettingsChanged):
                        self.window_opened.set()
                    if isinstance(event, _FREES_A_STREAM):
                        self.stream_freed.set()
                    if stream_id is not None and stream_id in self.streams:
                        self.streams[stream_id].put_nowait(event)
                    elif isinstance(event, h2.events.ConnectionTerminated):
                        break
                self.flush()
        except Exception:  # a dead connection ends every open stream below
            pass
        finally:
            self.closed = True
            self.window_opened.set()
            self.stream_freed.set()
            for queue in self.streams.values():
                queue.put_nowait(None)

    async def open_stream(self) -> tuple[int, asyncio.Queue[h2.events.Event | None]]:
        """A new stream, once the peer's SETTINGS_MAX_CONCURRENT_STREAMS allows it: beyond the
        limit h2 raised TooManyStreamsError, and a reused connection at a higher concurrency
        failed those requests in the client. The wait is in the request's TTFT, as on QUIC."""
        while self.h2.open_outbound_streams >= self.h2.remote_settings.max_concurrent_streams:
            if self.closed:
                raise ConnectionError("connection closed while waiting for a stream")
            self.stream_freed.clear()
            await self.stream_freed.wait()
        stream_id = self.h2.get_next_available_stream_id()
        queue: asyncio.Queue[h2.events.Event | None] = asyncio.Queue()
        self.streams[stream_id] = queue
        return stream_id, queue

    async def send_body(self, stream_id: int, body: bytes) -> None:
        """The request body in frames no larger than the peer allows, waiting for its window
        (RFC 9113 §4.2, §6.9): one DATA frame of the whole body failed every request over
        16 KiB, the default SETTINGS_MAX_FRAME_SIZE."""
        view = memoryview(body)
        while True:
            size = min(
                len(view),
                self.h2.local_flow_control_window(stream_id),
                self.h2.max_outbound_frame_size,
            )
            if size > 0 or not view:
                chunk, view = view[:size], view[size:]
                self.h2.send_data(stream_id, chunk.tobytes(), end_stream=not view)
                self.flush()
                if not view:
                    return
                continue
            if self.closed:
                raise ConnectionError("connection closed while sending the request body")
            self.window_opened.clear()
            await self.window_opened.wait()

    async def close(self) -> None:
        self.closed = True
        self.task.cancel()
        try:
            self.h2.close_connection()
            self.flush()
        except Exception:  # closing a broken connection
            pass
        self.writer.close()
        try:
            await self.task
        except asyncio.CancelledError:
            pass


def _abandon(conn: _Connection, stream_id: int) -> None:
    """Reset a stream the request left open (a timeout, a bad answer), so that it frees its
    slot under the peer's stream limit."""
    try:
        stream = conn.h2.streams.get(stream_id)
        if stream is not None and not stream.closed:
            conn.h2.reset_stream(stream_id, h2.errors.ErrorCodes.CANCEL)
            conn.flush()
    except Exception:  # a broken connection: nothing to reset
        pass
    conn.stream_freed.set()


class H2Client(StreamingClient):
    transport = "h2"

    def __init__(self, options: ClientOptions) -> None:
        self._options = options
        self._ssl = tcp_ssl_context(options, ["h2"])
        self._shared: _Connection | None = None
        self._lock = asyncio.Lock()

    async def _connect(self, target: Target) -> _Connection:
        if target.scheme != "https":
            raise ValueError("h2 needs an https:// URL (HTTP/2 over TLS, ALPN h2)")
        reader, writer = await asyncio.open_connection(
            target.host, target.port, ssl=self._ssl, server_hostname=target.server_name
        )
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        ssl_object = writer.get_extra_info("ssl_object")
        if ssl_object is None or ssl_object.selected_alpn_protocol() != "h2":
            writer.close()
            raise ConnectionError("server did not negotiate h2 (ALPN)")
        return _Connection(reader, writer)

    async def _connection(self, result: RequestResult, target: Target) -> _Connection:
        if self._options.new_connection_per_request:
            conn = await self._connect(target)
            result.connect_s = time.perf_counter() - result.start
            return conn
        async with self._lock:
            if self._shared is None or self._shared.closed:
                self._shared = await self._connect(target)
                result.connect_s = time.perf_counter() - result.start
            else:
                result.reused_connection = True
            return self._shared

    async def _exchange(
        self,
        result: RequestResult,
        target: Target,
        method: str,
        headers: list[tuple[str, str]],
        body: bytes,
        on_text: TextCallback | None,
    ) -> None:
        start = result.start
        conn = await self._connection(result, target)
        stream_id, queue = await conn.open_stream()
        try:
            request_headers = [
                (":method", method),
                (":scheme", "https"),
                (":authority", target.authority),
                (":path", target.path),
                ("content-length", str(len(body))),
                *headers,
            ]
            conn.h2.send_headers(stream_id, request_headers, end_stream=not body)
            conn.flush()
            if body:
                await conn.send_body(stream_id, body)
            parser: StreamParser | None = None
            while True:
                event = await queue.get()
                now = time.perf_counter() - start
                if event is None:
                    raise ConnectionError("connection closed before the response ended")
                if isinstance(event, h2.events.ResponseReceived):
                    for name, value in event.headers:
                        key, text = name.decode().lower(), value.decode()
                        if key == ":status":
                            result.status = int(text)
                        elif not key.startswith(":"):
                            result.headers.append((key, text))
                    result.headers_s = now
                    content_type = result.header("content-type") or ""
                    parser = StreamParser(
                        result, event_stream="event-stream" in content_type, on_text=on_text
                    )
                elif isinstance(event, h2.events.DataReceived):
                    if parser is None:
                        raise ConnectionError("DATA before HEADERS")
                    parser.feed(event.data, now)
                elif isinstance(event, h2.events.StreamEnded):
                    if parser is None:
                        raise ConnectionError("stream ended without a response")
                    parser.finish(now)
                    return
                elif isinstance(event, h2.events.StreamReset):
                    raise ConnectionError(f"stream reset by server (error {event.error_code})")
        finally:
            conn.streams.pop(stream_id, None)
            _abandon(conn, stream_id)
            if self._options.new_connection_per_request:
                await conn.close()

    async def aclose(self) -> None:
        if self._shared is not None:
            await self._shared.close()
            self._shared = None
