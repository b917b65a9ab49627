"""What one streamed request looked like from the client: timings, text and usage.

The definitions follow `sglang.bench_serving` (and genai-perf): TTFT is the time from the start of
the request (before the connection is opened) to the first SSE event that carries generated text;
the chat role chunk (`"content": ""`) does not count. ITL is the list of gaps between successive
content events; for the native `/generate` route a gap covering several new tokens is split evenly
across them (bench_serving's `adjust_itl`). Latency is the time of the last byte of the stream.

`StreamParser` is sans-I/O: the transports feed it body bytes with the time they arrived.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

TextCallback = Callable[[str], None]
BODY_SHOWN = 200  # bytes of an error answer's body kept in `RequestResult.error`


@dataclass(slots=True)
class RequestResult:
    """One request as the client saw it. All times are seconds relative to `start`."""

    transport: str  # "h3" | "h2" | "h1"
    start: float = 0.0  # time.perf_counter() just before the connection was opened (or reused)
    status: int | None = None
    headers: list[tuple[str, str]] = field(default_factory=list)  # lowercase names
    connect_s: float | None = None  # connection ready (handshake complete); None when reused
    headers_s: float | None = None  # response status line / HEADERS frame received
    ttft_s: float | None = None  # first event carrying generated text
    latency_s: float | None = None  # last byte of the response
    content_times: list[float] = field(default_factory=list)  # each content event
    itl_s: list[float] = field(default_factory=list)
    text: str = ""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    reused_connection: bool = False
    early_data: bool = False  # the request was sent in 0-RTT early data
    early_data_accepted: bool | None = None  # the server's verdict (None when not attempted)
    error: str | None = None

    def header(self, name: str) -> str | None:
        """The first response header called `name` (case-insensitive), or None."""
        name = name.lower()
        for key, value in self.headers:
            if key == name:
                return value
        return None

    @property
    def backend(self) -> str | None:
        return self.header("x-quicedge-backend")

    @property
    def ok(self) -> bool:
        return self.error is None and self.status == 200 and self.ttft_s is not None


def _int_or_none(value: Any) -> int | None:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


class StreamParser:
    """Turns response body bytes into content events, usage and errors, fed as they arrive."""

    def __init__(
        self,
        result: RequestResult,
        *,
        event_stream: bool = True,
        on_text: TextCallback | None = None,
    ) -> None:
        self._result = result
        self._on_text = on_text
        self._event_stream = event_stream
        self._buffer = b""
        self._body: list[bytes] = []  # only for non-streaming responses
        self._native_text_len = 0  # /generate sends the cumulative text
        self._native_tokens = 0

    def feed(self, data: bytes, now: float) -> None:
        """Body bytes received at `now` (seconds relative to the request start)."""
        self._result.latency_s = now
        if not self._event_stream:
            self._body.append(data)
            return
        self._buffer += data
        # SSE events end with a blank line (WHATWG HTML §9.2); accept \r\n too.
        while True:
            cut = self._buffer.find(b"\n")
            if cut < 0:
                return
            line, self._buffer = self._buffer[:cut].rstrip(b"\r"), self._buffer[cut + 1 :]
            if line.startswith(b"data:"):
                self._on_data(line[5:].strip(), now)

    def finish(self, now: float) -> None:
        """The body ended at `now`."""
        self._result.latency_s = now
        if self._event_stream:
            if self._buffer.startswith(b"data:"):
                self._on_data(self._buffer[5:].strip(), now)
            self._buffer = b""
            result = self._result
            if result.status == 200 and result.error is None and result.ttft_s is None:
                result.error = "the stream carried no generated text"
            return
        body = b"".join(self._body)
        status = self._result.status
        try:
            payload = json.loads(body) if body else None
        except ValueError:
            payload = None
            if status == 200:
                self._result.error = "response body is not JSON"
        if isinstance(payload, dict):
            self._on_payload(payload, now, streaming=False)
        if status != 200 and self._result.error is None and body:
            # An error answer without an OpenAI-shaped "error" (a proxy's HTML page, SGLang's
            # top-level "message"): show its start, which printed nothing but the status.
            shown = " ".join(body[:BODY_SHOWN].decode(errors="replace").split())
            self._result.error = f"HTTP {status}: {shown}"

    def _on_data(self, data: bytes, now: float) -> None:
        if data == b"[DONE]" or not data:
            return
        try:
            payload = json.loads(data)
        except ValueError:
            self._result.error = f"bad SSE event: {data[:80]!r}"
            return
        if isinstance(payload, dict):
            self._on_payload(payload, now, streaming=True)

    def _on_payload(self, payload: dict[str, Any], now: float, *, streaming: bool) -> None:
        result = self._result
        error = payload.get("error")
        if error is not None:
            message = error.get("message") if isinstance(error, dict) else error
            result.error = str(message)
            return
        usage = payload.get("usage")
        if isinstance(usage, dict):
            result.prompt_tokens = _int_or_none(usage.get("prompt_tokens"))
            result.completion_tokens = _int_or_none(usage.get("completion_tokens"))
            details = usage.get("prompt_tokens_details")
            cached = details.get("cached_tokens") if isinstance(details, dict) else None
            # SGLang omits the details when nothing was cached (and without --enable-cache-report).
            result.cached_tokens = _int_or_none(cached) if cached is not None else 0
        new_text, new_tokens = self._new_text(payload)
        if not new_text:
            return
        if self._on_text is not None:
            self._on_text(new_text)
        if not streaming:
            result.text = new_text
            result.ttft_s = now
            result.content_times.append(now)
            return
        result.text += new_text
        if result.content_times:
            gap = now - result.content_times[-1]
            count = max(new_tokens, 1)
            result.itl_s.extend([gap / count] * count)
        else:
            result.ttft_s = now
        result.content_times.append(now)

    def _new_text(self, payload: dict[str, Any]) -> tuple[str, int]:
        """The generated text this event adds, and how many tokens it covers (0 if unknown)."""
        choices = payload.get("choices")
        if isinstance(choices, list):
            parts: list[str] = []
            for choice in choices:
                if not isinstance(choice, dict):
                    continue
                delta = choice.get("delta")
                message = choice.get("message")
                if isinstance(delta, dict) and isinstance(delta.get("content"), str):
                    parts.append(delta["content"])
                elif isinstance(message, dict) and isinstance(message.get("content"), str):
                    parts.append(message["content"])
                elif isinstance(choice.get("text"), str):
                    parts.append(choice["text"])
            return "".join(parts), 0
        text = payload.get("text")
        if not isinstance(text, str):
            return "", 0
        meta = payload.get("meta_info")
        if isinstance(meta, dict):
            result = self._result
            result.prompt_tokens = _int_or_none(meta.get("prompt_tokens"))
            result.cached_tokens = _int_or_none(meta.get("cached_tokens"))
            tokens = _int_or_none(meta.get("completion_tokens"))
            result.completion_tokens = tokens
        else:
            tokens = None
        # Native /generate streams the cumulative text; print only what is new.
        new = text[self._native_text_len :]
        self._native_text_len = len(text)
        new_tokens = 0
        if tokens is not None:
            new_tokens, self._native_tokens = tokens - self._native_tokens, tokens
        return new, new_tokens
