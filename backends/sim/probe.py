"""A minimal HTTP/1.1 client (h11, one connection per call) for the check and calibration tools.

It measures what a client sees: the time from sending a request to the first SSE event that
carries generated text, like `sglang.bench_serving` does. Kept here, not borrowed from the
proxy, because `backends.sim` depends on nothing of the proxy.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import h11


@dataclass(slots=True)
class StreamResult:
    status: int
    ttft: float | None  # seconds to the first event with generated text
    total: float
    events: list[Any] = field(default_factory=list)  # decoded `data:` payloads


async def _exchange(
    url: str, method: str, path: str, body: bytes | None, *, on_data: Any = None
) -> tuple[int, bytes]:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    reader, writer = await asyncio.open_connection(host, port)
    conn = h11.Connection(h11.CLIENT)
    headers = [(b"host", parts.netloc.encode()), (b"connection", b"close")]
    if body is not None:
        headers += [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    out = conn.send(h11.Request(method=method, target=path, headers=headers))
    if body:
        out += conn.send(h11.Data(data=body))
    out += conn.send(h11.EndOfMessage())
    writer.write(out)
    status, data = 0, bytearray()
    try:
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await reader.read(65536))
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                data += event.data
                if on_data is not None:
                    on_data(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                return status, bytes(data)
    finally:
        writer.close()


async def get(url: str, path: str) -> tuple[int, bytes]:
    return await _exchange(url, "GET", path, None)


async def get_json(url: str, path: str) -> Any:
    status, body = await get(url, path)
    if status != 200:
        raise RuntimeError(f"GET {path}: HTTP {status}")
    return json.loads(body)


async def post_json(url: str, path: str, payload: Any) -> tuple[int, Any]:
    status, body = await _exchange(url, "POST", path, json.dumps(payload).encode())
    return status, (json.loads(body) if body else None)


def _has_text(event: Any) -> bool:
    if not isinstance(event, dict):
        return False
    if "text" in event and "meta_info" in event:  # /generate
        return bool(event["text"]) or bool(event.get("output_ids"))
    for choice in event.get("choices") or ():
        delta = choice.get("delta") or {}
        if delta.get("content") or choice.get("text"):
            return True
    return False


async def stream(url: str, path: str, payload: Any) -> StreamResult:
    """POST a streaming request; TTFT is taken at the first event carrying generated text."""
    start = time.perf_counter()
    buffer = bytearray()
    result = StreamResult(status=0, ttft=None, total=0.0)

    def on_data(chunk: bytes) -> None:
        buffer.extend(chunk)
        while (end := buffer.find(b"\n\n")) >= 0:
            line = bytes(buffer[:end]).strip()
            del buffer[: end + 2]
            if not line.startswith(b"data: "):
                continue
            raw = line[len(b"data: ") :]
            event = raw.decode() if raw == b"[DONE]" else json.loads(raw)
            if result.ttft is None and _has_text(event):
                result.ttft = time.perf_counter() - start
            result.events.append(event)

    status, _ = await _exchange(url, "POST", path, json.dumps(payload).encode(), on_data=on_data)
    result.status = status
    result.total = time.perf_counter() - start
    return result
