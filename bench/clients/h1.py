"""HTTP/1.1 client: h11 on asyncio streams, plain or TLS, one request at a time per connection."""

from __future__ import annotations

import asyncio
import socket
import time

import h11

from bench.clients.base import ClientOptions, StreamingClient, Target, tcp_ssl_context
from bench.stream import RequestResult, StreamParser, TextCallback

READ_SIZE = 65536


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.h11 = h11.Connection(h11.CLIENT)

    def close(self) -> None:
        self.writer.close()


class H1Client(StreamingClient):
    transport = "h1"

    def __init__(self, options: ClientOptions) -> None:
        self._options = options
        self._ssl = tcp_ssl_context(options, ["http/1.1"])
        self._idle: list[_Connection] = []  # keep-alive connections when reusing

    async def _connect(self, target: Target) -> _Connection:
        tls = self._ssl if target.scheme == "https" else None
        reader, writer = await asyncio.open_connection(
            target.host,
            target.port,
            ssl=tls,
            server_hostname=target.server_name if tls else None,
            limit=READ_SIZE,
        )
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return _Connection(reader, writer)

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
        conn: _Connection | None = None
        if not self._options.new_connection_per_request and self._idle:
            conn = self._idle.pop()
            result.reused_connection = True
        else:
            conn = await self._connect(target)
            result.connect_s = time.perf_counter() - start
        keep = False
        try:
            request_headers = [("host", target.authority), ("content-length", str(len(body)))]
            request_headers += headers
            request = h11.Request(method=method, target=target.path, headers=request_headers)
            out = conn.h11.send(request) or b""
            if body:
                out += conn.h11.send(h11.Data(data=body)) or b""
            out += conn.h11.send(h11.EndOfMessage()) or b""
            conn.writer.write(out)
            parser: StreamParser | None = None
            while True:
                event = conn.h11.next_event()
                if event is h11.NEED_DATA:
                    data = await conn.reader.read(READ_SIZE)
                    conn.h11.receive_data(data)  # b"" = EOF; h11 raises if the body was cut
                    continue
                now = time.perf_counter() - start
                if isinstance(event, h11.Response):
                    result.status = event.status_code
                    result.headers = [(k.decode().lower(), v.decode()) for k, v in event.headers]
                    result.headers_s = now
                    content_type = result.header("content-type") or ""
                    parser = StreamParser(
                        result, event_stream="event-stream" in content_type, on_text=on_text
                    )
                elif isinstance(event, h11.Data):
                    assert parser is not None
                    parser.feed(bytes(event.data), now)
                elif isinstance(event, h11.EndOfMessage):
                    assert parser is not None
                    parser.finish(now)
                    break
                elif isinstance(event, h11.ConnectionClosed):
                    raise ConnectionError("connection closed before the response ended")
            keep = (
                not self._options.new_connection_per_request
                and conn.h11.our_state is h11.DONE
                and conn.h11.their_state is h11.DONE
            )
            if keep:
                conn.h11.start_next_cycle()
                self._idle.append(conn)
        finally:
            if not keep:
                conn.close()

    async def aclose(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
