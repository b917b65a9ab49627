"""The SSE scanner: what accounting needs from a `text/event-stream` body, without I/O.

Only what accounting needs is parsed: which chunk carries the first content token (TTFT), how
many content events a chunk completes (ITL), and, once at the end, the usage the backend reports
(`prompt_tokens`, `cached_tokens`) and the generated text when it comes cheaply. `SSEScanner`
finds event boundaries incrementally and never rescans bytes it has seen; a cheap regex tells
content events from the chat role chunk and the usage/finish chunks, and JSON is decoded only for
the last event and for error events. The relay (`edge.relay`) feeds it what it passes on.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import orjson

# The JSON string member `"content": "..."` (chat deltas) or `"text": "..."` (completions,
# /generate); group 1 is the string literal's body, still escaped. The literal prefix lets the
# regex engine skip to candidates with a fast substring search instead of trying every `"`.
_FIELDS = {
    # the string body "unrolled" (runs of plain characters, then one escape): one step per run,
    # where an alternation per character would cost a step for each character
    field: re.compile(rb'"' + field + rb'":\s*"([^"\\]*(?:\\.[^"\\]*)*)"', re.DOTALL)
    for field in (b"content", b"text")
}
_MAX_PIECES = 256 * 1024
"""Bytes of OpenAI stream deltas kept for routing feedback; a longer answer is not learned."""
_BATCH = 64 * 1024
"""Bytes of events gathered before their delta texts are extracted, in one regex pass."""
_DONE = b"[DONE]"
_DONE_LINE = b"data: [DONE]"
ARGUMENTS_KEY = b'"arguments":'
# A chat tool call's `"arguments": "..."` delta (group 1: the escaped string body).
ARGUMENTS = re.compile(ARGUMENTS_KEY + rb'\s*"([^"\\]*(?:\\.[^"\\]*)*)"', re.DOTALL)
REASONING_KEY = b'"reasoning_content":'
# A reasoning model's thinking delta (SGLang with `--reasoning-parser`), group 1 as above.
REASONING = re.compile(REASONING_KEY + rb'\s*"([^"\\]*(?:\\.[^"\\]*)*)"', re.DOTALL)
_INDEX = b'"index":'
"""A `/generate` batch's stream: each output names its prompt (`result["index"]`, SGLang's
tokenizer_manager.py `_handle_batch_request`); a single prompt's outputs have no such key (a
quote inside JSON text is escaped, so the bytes cannot come from a text)."""
_USAGE_KEY = b'"usage":'
_MAX_TAIL = 1 << 20
"""An SSE event larger than this (1 MiB) is relayed but not scanned: accounting skips it, and
scans again from the next event (a /generate stream's cumulative events pass it in a long
answer with logprobs)."""


_NO_CHOICES = b'"choices":[]'
_NO_CHOICES_SPACED = b'"choices": []'
"""What marks an OpenAI stream's usage chunk (and nothing else a backend sends)."""


def _without_usage_chunks(region: bytes) -> bytes:
    """`region`'s events, each with its blank line, less the usage chunks among them."""
    if b"\n\n" not in region:  # one event, as SGLang writes the usage chunk
        return b"" if _is_usage_chunk(region) else region + b"\n\n"
    kept = [event for event in region.split(b"\n\n") if not _is_usage_chunk(event)]
    return b"".join(event + b"\n\n" for event in kept)


def _is_usage_chunk(event: bytes) -> bool:
    """An event whose JSON has `"choices": []` and a `"usage"` object: read from its bytes, as
    a quote inside JSON text is escaped, so these can only be the JSON's own members (a JSON
    decode here was most of what the strip cost)."""
    return (_NO_CHOICES in event or _NO_CHOICES_SPACED in event) and has_object(event, _USAGE_KEY)


def has_string(region: bytes, key: bytes) -> bool:
    """`key` with a string value somewhere in `region` (compact or `": "` spacing)."""
    return key + b'"' in region or key + b' "' in region


def has_object(region: bytes, key: bytes) -> bool:
    """`key` with an object value somewhere in `region` (compact or `": "` spacing)."""
    return key + b"{" in region or key + b" {" in region


@dataclass(slots=True)
class Usage:
    """Token counts the backend reported, when it did."""

    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None


def _sum(counts: list[Usage]) -> Usage:
    """The counts of a batch's answers together (a count none of them reports stays None)."""

    def total(values: list[int | None]) -> int | None:
        known = [v for v in values if v is not None]
        return sum(known) if known else None

    return Usage(
        total([u.prompt_tokens for u in counts]),
        total([u.cached_tokens for u in counts]),
        total([u.completion_tokens for u in counts]),
    )


def usage_from(obj: Any) -> Usage:
    """Counts from one response object: SGLang `meta_info` or OpenAI `usage`; a whole
    `/generate` batch (a list of outputs) counts all its outputs."""
    if isinstance(obj, list):
        return _sum([usage_from(item) for item in obj])
    if not isinstance(obj, dict):
        return Usage()
    meta = obj.get("meta_info")
    if isinstance(meta, dict):  # /generate: every chunk carries the counts so far
        return Usage(
            _int(meta.get("prompt_tokens")),
            _int(meta.get("cached_tokens")),
            _int(meta.get("completion_tokens")),
        )
    usage = obj.get("usage")
    if isinstance(usage, dict):
        details = usage.get("prompt_tokens_details")
        # SGLang fills prompt_tokens_details only with --enable-cache-report and a count > 0;
        # null is ambiguous (off, or zero), so it is reported as unknown rather than as a miss.
        cached = _int(details.get("cached_tokens")) if isinstance(details, dict) else None
        return Usage(_int(usage.get("prompt_tokens")), cached, _int(usage.get("completion_tokens")))
    return Usage()


def text_from(obj: Any) -> str | None:
    """The generated text of a whole answer (or of /generate's cumulative last chunk)."""
    if not isinstance(obj, dict):
        return None
    text = obj.get("text")
    if isinstance(text, str):  # /generate
        return text
    choices = obj.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        choice = choices[0]
        message = choice.get("message")
        if isinstance(message, dict) and isinstance(message.get("content"), str):
            return str(message["content"])  # chat
        if isinstance(choice.get("text"), str):
            return str(choice["text"])  # completions
    return None


def _int(value: Any) -> int | None:
    """A count as reported: a non-negative integer, else unknown (a negative completion count
    would give a tenant's tokens back when its answer is debited)."""
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
    return value if ok else None


def _data_of(event: bytes) -> bytes | None:
    """The payload of an event's `data:` field (SGLang sends one data line per event)."""
    if event.startswith(b"data: ") and b"\n" not in event:
        return event[6:]  # the usual shape, found without splitting
    for line in event.split(b"\n"):
        if line.startswith(b"data:"):
            return line[5:].strip()
    return None


class SSEScanner:
    """Incremental `text/event-stream` scanner: feed chunks, learn what accounting needs.

    Events end at a blank line (`\\n\\n`; SGLang writes LF line ends, one `data:` line per event).
    A stream with CR line ends (CRLF, as sse-starlette servers write) is passed on with LF
    ones, which SSE reads alike; scanned as written, none of its events would end before the
    stream did.
    A chunk is scanned as a whole, not event by event: the complete events in it are one region,
    searched with a few C-level calls (counts, one regex `findall`), whatever their number; a
    busy edge reads many tokens at once, and a loop per event would be most of its relay cost. Bytes
    of an incomplete event wait in `_tail`, searched again only from where the last search
    stopped. Error events, rare, are parsed one by one.

    `field` is the JSON member that carries generated text (`content` for chat, `text` for the
    others); `deltas` says whether it is a delta (OpenAI) or /generate's cumulative text.
    """

    __slots__ = (
        "_content",
        "_deltas",
        "_last_region",
        "_compact",
        "_compact_empty",
        "_key",
        "_pending",
        "_pending_size",
        "_pieces",
        "_pieces_size",
        "_tail",
        "_batch",
        "_choices",
        "_chat",
        "_cr",
        "_skipping",
        "_newline",
        "_strip_usage",
        "_usage_seen",
        "content_events",
        "done",
        "error",
        "events",
    )

    def __init__(
        self, field: bytes = b"content", *, deltas: bool = True, strip_usage: bool = False
    ) -> None:
        self._content = _FIELDS[field]
        self._strip_usage = strip_usage
        self._usage_seen = False
        """The edge asked for the usage chunk, not the client (`forward.ask_usage`): it is
        read here and not passed on."""
        self._deltas = deltas
        self._tail = b""
        self._last_region = b""
        """The last region that held a data event other than `[DONE]`."""
        self.events = 0
        """Complete data events seen (not counting `[DONE]`)."""
        self.content_events = 0
        """Events that carried generated text."""
        self.error: dict[str, Any] | None = None
        """The `error` object of an error event, if the backend sent one."""
        self.done = False
        """`data: [DONE]` was seen."""
        self._pieces: list[bytes] | None = []
        """Escaped text of each OpenAI delta, decoded once at the end (None: gave up)."""
        self._pieces_size = 0
        self._pending: list[bytes] = []
        """Regions with content whose text is not extracted yet."""
        self._pending_size = 0
        self._key = b'"' + field + b'":'
        self._compact = self._key + b'"'
        self._compact_empty = self._compact + b'"'
        self._cr = False
        """The last chunk ended with a CR: an LF that starts the next ends the same line."""
        self._skipping = False
        """An event over `_MAX_TAIL` is being passed on unscanned, until its blank line."""
        self._newline = False
        """While skipping: the last byte passed on was an LF (a blank line may straddle)."""
        self._batch: dict[int, Usage] = {}
        """A `/generate` batch stream's last counts per prompt index (empty: not a batch)."""
        self._choices: dict[int, Usage] = {}
        """An OpenAI stream's last per-choice counts (`continuous_usage_stats` puts each
        chunk's own choice's counts on it), by choice index."""
        self._chat = field == b"content"
        """Chat: tool-call arguments and reasoning are generated tokens too (counted, not
        collected)."""

    @classmethod
    def for_route(cls, route: str, *, strip_usage: bool = False) -> SSEScanner:
        if route == "/generate":
            return cls(b"text", deltas=False)
        field = b"content" if route == "/v1/chat/completions" else b"text"
        return cls(field, strip_usage=strip_usage)

    def feed(self, chunk: bytes) -> int:
        """Scan `chunk`; return how many content events it completed."""
        return self.take(chunk)[1]

    def take(self, chunk: bytes) -> tuple[bytes, int]:
        """Scan `chunk`; return the complete events so far, which may be passed on, and how
        many content events they hold. The bytes of an event still incomplete are held (an SSE
        client dispatches nothing before an event's blank line, so holding them delays
        nothing): a stream that fails after them ends with a well-formed error event, not one
        glued to half an event. An event past `_MAX_TAIL` held bytes passes unscanned, up to
        its blank line; the events after it are scanned."""
        if self._cr:
            self._cr = False
            if chunk[:1] == b"\n":
                chunk = chunk[1:]
        if b"\r" in chunk:  # (a CR in JSON text is escaped: a raw one ends a line)
            self._cr = chunk.endswith(b"\r")
            chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        if self._skipping:
            return self._skip(chunk)
        return self._split(chunk)

    def _skip(self, chunk: bytes) -> tuple[bytes, int]:
        """Pass on the rest of an event too large to scan; scan what follows its end."""
        if self._newline and chunk[:1] == b"\n":
            cut = 1
        else:
            end = chunk.find(b"\n\n")
            if end < 0:
                if chunk:
                    self._newline = chunk.endswith(b"\n")
                return chunk, 0
            cut = end + 2
        self._skipping = False
        if cut == len(chunk):
            return chunk, 0
        rest, content = self._split(chunk[cut:])
        return chunk[:cut] + rest, content

    def _split(self, chunk: bytes) -> tuple[bytes, int]:
        """`take` for LF line ends: the complete events of `chunk` after the held bytes."""
        tail = self._tail
        if tail:
            data = tail + chunk
            # the tail held no separator; one may straddle the old end, so start a byte before
            end = data.find(b"\n\n", len(tail) - 1)
            if end >= 0:
                end = data.rfind(b"\n\n", end)
        else:
            data = chunk
            end = data.rfind(b"\n\n")
        if end < 0:
            if len(data) > _MAX_TAIL:  # no event boundary in sight: stop holding
                self._tail = b""
                self._skipping = True
                self._newline = data.endswith(b"\n")
                return data, 0
            self._tail = data
            return b"", 0
        cut = end + 2
        region = data[:end]
        content = self._scan(region)
        if cut == len(data):
            self._tail = b""
        else:
            self._tail, data = data[cut:], data[:cut]
        if self._usage_seen and self._strip_usage:  # (set by `_scan`: a region with usage)
            self._usage_seen = False
            if _NO_CHOICES in region or _NO_CHOICES_SPACED in region:
                data = _without_usage_chunks(region)
        return data, content

    def rest(self) -> bytes:
        """The bytes held after the last complete event (the stream ended without a blank
        line after them); handed out once."""
        tail = self._tail  # (empty while an event too large to hold is passed on)
        self._tail = b""
        return tail

    def _scan(self, region: bytes) -> int:
        """Account for `region`, one or more complete events (separators between them)."""
        events = region.count(b"\n\ndata:") + region.startswith(b"data:")
        if not events:
            return 0  # comments or other fields only: relayed, not counted
        if region.endswith(_DONE_LINE) and (
            len(region) == len(_DONE_LINE) or region.endswith(b"\n\n" + _DONE_LINE)
        ):  # anchored: JSON text may say "data: [DONE]" too
            self.done = True
            events -= 1
        if not events:
            return 0
        self.events += events
        self._last_region = region
        if b'"error"' in region:
            self._scan_errors(region)
        if not self._deltas and _INDEX in region:
            self._scan_batch(region)
        elif self._deltas and has_object(region, _USAGE_KEY):
            self._scan_choice_usage(region)
            self._usage_seen = True
        # Non-empty text fields, counted in compact JSON (SGLang's) by two substring counts;
        # other spacing takes the regex. The text itself is extracted in batches (`_collect`).
        content = region.count(self._compact)
        if content:
            content -= region.count(self._compact_empty)
        elif self._key in region:
            content = sum(1 for m in self._content.findall(region) if m)
        if not content and self._chat:
            # A tool call's arguments and a reasoning model's thinking are tokens the client
            # gets too: they count for the first token and the gaps. Only looked for here,
            # after the text count found none, so a text stream pays nothing for them.
            other = 0
            if has_string(region, ARGUMENTS_KEY):
                other += sum(1 for m in ARGUMENTS.findall(region) if m)
            if has_string(region, REASONING_KEY):  # SGLang sends `null` in every text chunk
                other += sum(1 for m in REASONING.findall(region) if m)
            self.content_events += other
            return other
        if content:
            self.content_events += content
            if self._deltas and self._pieces is not None:
                self._pending.append(region)
                self._pending_size += len(region)
                if self._pending_size >= _BATCH:
                    self._collect()
        return content

    def _collect(self) -> None:
        """Extract the escaped delta texts of the regions kept so far, in one regex pass."""
        pending, self._pending, self._pending_size = self._pending, [], 0
        if self._pieces is None or not pending:
            return
        found = [m for m in self._content.findall(b"\n\n".join(pending)) if m]
        self._pieces_size += sum(map(len, found))
        if self._pieces_size <= _MAX_PIECES:
            self._pieces += found
        else:
            self._pieces = None

    def _scan_errors(self, region: bytes) -> None:
        for event in region.split(b"\n\n"):
            payload = _data_of(event)
            if payload is not None and payload[:16].find(b'"error"') >= 0:
                self._record_error(payload)

    def _scan_batch(self, region: bytes) -> None:
        """Keep the counts of each prompt of a `/generate` batch (its events are cumulative per
        prompt, so the last one of each index holds that prompt's counts)."""
        for event in region.split(b"\n\n"):
            payload = _data_of(event)
            if payload is None or _INDEX not in payload:
                continue
            try:
                obj = orjson.loads(payload)
            except ValueError:
                continue
            index = obj.get("index") if isinstance(obj, dict) else None
            if isinstance(index, int) and not isinstance(index, bool):
                self._batch[index] = usage_from(obj)

    def _scan_choice_usage(self, region: bytes) -> None:
        """Keep the counts a chunk of one choice carries (`continuous_usage_stats`), by the
        choice's index: with `n` > 1 each choice's are its own (SGLang's serving_chat.py and
        serving_completions.py), so the last chunk's are not the answer's."""
        for event in region.split(b"\n\n"):
            payload = _data_of(event)
            if payload is None or not has_object(payload, _USAGE_KEY):
                continue
            try:
                obj = orjson.loads(payload)
            except ValueError:
                continue
            choices = obj.get("choices") if isinstance(obj, dict) else None
            if not isinstance(choices, list) or len(choices) != 1:
                continue  # the usage chunk (`choices: []`) is the answer's own
            index = choices[0].get("index") if isinstance(choices[0], dict) else None
            if isinstance(index, int) and not isinstance(index, bool):
                self._choices[index] = usage_from(obj)

    def _record_error(self, payload: bytes) -> None:
        try:
            obj = orjson.loads(payload)
        except ValueError:
            self.error = {"message": "unparseable error event"}
            return
        err = obj.get("error") if isinstance(obj, dict) else None
        self.error = err if isinstance(err, dict) else {"message": str(err)}

    @property
    def last_data(self) -> bytes | None:
        """Payload of the last data event before `[DONE]` (usage/meta_info live there)."""
        for event in reversed(self._last_region.split(b"\n\n")):
            payload = _data_of(event)
            if payload is not None and payload != _DONE:
                return payload
        return None

    def final(self) -> tuple[Usage, str | None]:
        """Decode the last data event once, at the end of the stream: usage, and the whole
        generated text when the stream is /generate's (its text is cumulative)."""
        last = self.last_data
        if last is None:
            return Usage(), None
        try:
            obj = orjson.loads(last)
        except ValueError:
            return Usage(), None
        text = obj.get("text") if isinstance(obj, dict) and "meta_info" in obj else None
        if not isinstance(text, str):
            text = self._joined_pieces()
        if self._batch:  # a batch: every prompt's counts, not the last event's
            return _sum(list(self._batch.values())), text
        choices = obj.get("choices") if isinstance(obj, dict) else None
        if len(self._choices) > 1 and choices:
            # Several choices, and the last event is one choice's chunk, not a usage chunk
            # summed over them: the completion tokens are every choice's; the prompt's are
            # not known (the choices of one prompt share it, a batch's prompts do not).
            completion = _sum(list(self._choices.values())).completion_tokens
            return Usage(completion_tokens=completion), text
        return usage_from(obj), text

    def _joined_pieces(self) -> str | None:
        """The OpenAI stream's generated text: the deltas' escaped bodies joined into one JSON
        string and decoded once (escapes never span two deltas, so the join stays valid)."""
        if not self._deltas:
            return None
        self._collect()
        if not self._pieces:
            return None
        try:
            text = orjson.loads(b'"' + b"".join(self._pieces) + b'"')
        except ValueError:
            return None
        return text if isinstance(text, str) else None

    def usage(self) -> Usage:
        return self.final()[0]


def answer_of_body(body: bytes) -> tuple[Usage, str | None]:
    """Counts and generated text of a non-streaming JSON answer (decoded once, for accounting)."""
    try:
        obj = orjson.loads(body)
    except ValueError:
        return Usage(), None
    return usage_from(obj), text_from(obj)


__all__ = [
    "ARGUMENTS",
    "ARGUMENTS_KEY",
    "SSEScanner",
    "Usage",
    "answer_of_body",
    "text_from",
    "usage_from",
]
