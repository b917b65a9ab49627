"""Stream policies: patterns watched for in the generated text, across SSE chunk boundaries.

A `StreamGuard` sits in the relay, one per streamed answer, and sees every upstream chunk before
the client does. It decodes the text of each complete SSE event (one ends at any blank line:
`\\n\\n`, `\\r\\n\\r\\n`, `\\r\\r`; in a chat stream, a tool call's arguments and a reasoning
model's `reasoning_content` too: the client gets them as it gets text), folds it
(`normalize.fold`) into a window of the last `lookbehind` characters of that text (one window
per choice and per text in it: see `StreamGuard`), and searches the rules there with RE2
(linear time: no generated text can make a pattern backtrack, and the relay's event loop with
it):

- no match: the events are passed on at once, unchanged;
- a match: the chunk that completed it (and anything held) is dropped, the stream ends with a
  well-formed final chunk with `finish_reason: "content_filter"` and `data: [DONE]`, and the
  relay aborts the upstream request;
- with `stream_hold` on, also: the tail could be the start of a match (`BEGIN PRIV` of
  `BEGIN PRIVATE KEY`; RE2 has no partial matching, so a second RE2 expression, built from
  the patterns, matches the prefixes of their matches): the events from there on are held back
  until the match completes or fails, so no part of a match reaches the client (those tokens
  wait for the deciding ones).

By default nothing is held but the bytes of an incomplete event (the client could not parse
them yet either); an event the upstream ends without its blank line is checked at the stream's
end. A match that ends where the text so far does and rests on an assertion there (`\\b`, `$`)
waits for the window's next text, or its choice's or the stream's end, to decide it: the end of
a chunk is not the end of the text. A match longer than `lookbehind` characters is not caught.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import orjson
import re2

from edge.policy.config import PolicyConfig
from edge.policy.normalize import fold
from edge.sse import ARGUMENTS, ARGUMENTS_KEY, REASONING, REASONING_KEY

_FIELDS = {
    field: re.compile(rb'"' + field + rb'":\s*"([^"\\]*(?:\\.[^"\\]*)*)"', re.DOTALL)
    for field in (b"content", b"text")
}
_ID = re.compile(rb'"id":\s*"([^"\\]{1,200})"')
_MODEL = re.compile(rb'"model":\s*"([^"\\]{1,200})"')


@dataclass(slots=True)
class StreamRules:
    """The compiled stream rules; `guard(route)` makes the per-stream state."""

    pattern: Any
    """Every rule's patterns as one RE2 alternation (no groups: it only says where)."""
    rules: list[Any]
    """Each rule's own RE2, to name the one that matched (only after a match)."""
    ids: list[str]
    lookbehind: int
    hold: bool = False
    span: int = 0
    """The longest match any rule can make, capped at `lookbehind`: only the window's last
    `span - 1` characters can hold the start of a match that ends in new text."""
    starts: Any = None
    """RE2 matching, at the end of the text, a non-empty prefix of some rule's match: the tail
    could be the start of one (hold mode)."""

    @classmethod
    def from_config(cls, config: PolicyConfig) -> StreamRules | None:
        if not config.stream_rules:
            return None
        sources: list[str] = []
        nodes: list[_Node] = []
        try:
            for rule in config.stream_rules:
                sources.append("|".join(_group(_source(p, rule.literal)) for p in rule.patterns))
                nodes.extend(_node(p, rule.literal) for p in rule.patterns)
            pattern = _compile("|".join(_group(s) for s in sources))
            rules = [_compile(s) for s in sources]
            starts = _compile(_group("|".join(_prefix(n) for n in nodes)) + "\\z")
        except (ValueError, RecursionError) as exc:  # (each passed `check_pattern`: their sum)
            raise ValueError(f"policy.stream_rules: {exc}") from None
        span = max(_widths(n)[1] for n in nodes)
        lookbehind = config.stream_lookbehind
        ids = [r.id for r in config.stream_rules]
        return cls(pattern, rules, ids, lookbehind, config.stream_hold, min(span, lookbehind),
                   starts)  # fmt: skip

    def guard(self, route: str) -> StreamGuard:
        return StreamGuard(self, route)

    def match(self, text: bytes, pos: int) -> str | None:
        """The id of the rule with the leftmost match in `text[pos:]` (UTF-8), or None."""
        start = self.pattern.Match(_UNANCHORED, text, pos, len(text))[0][0]
        return None if start < 0 else self.rule_at(text, start)

    def rule_at(self, text: bytes, start: int) -> str:
        """The rule whose match the alternation found at `start`: leftmost-first, as the
        alternation, the first rule that matches there."""
        for rule_id, rule in zip(self.ids, self.rules, strict=True):
            if rule.Match(_ANCHOR_START, text, start, len(text))[0] != _NO_SPAN:
                return rule_id
        return self.ids[0]  # (unreachable: the alternation matched there)

    def certain(self, text: bytes, pos: int) -> bool:
        """Whether `text[pos:]` holds a match whatever follows it. A match that ends where the
        text does may rest on an assertion there (`\\b`, `$`, `\\z`) that the next character
        decides: the search runs again with each kind of next character (a word character, a
        newline, any other) as context after the end."""
        end = len(text)
        return all(
            self.pattern.Match(_UNANCHORED, text + after, pos, end)[0][0] >= 0 for after in _NEXT
        )

    def could_start(self, text: bytes, pos: int) -> bool:
        """Whether `text` ends with a non-empty prefix of a match starting at `pos` or later."""
        return bool(self.starts.Match(_UNANCHORED, text, pos, len(text))[0][0] < len(text))


def check_pattern(pattern: str) -> str | None:
    """Why `pattern` cannot be a stream rule's (not RE2, or able to match nothing at all), or
    None when it can."""
    try:
        _compile(pattern)
        node = _Parser(pattern).parse()
        if _widths(node)[0] == 0:
            return "it can match the empty string, so it would end every stream"
        _compile(_group(_prefix(node)) + "\\z")
    except RecursionError:
        return "nested too deeply"
    except ValueError as exc:
        return str(exc)
    return None


Key = tuple[int, int, int]
"""Whose text a window holds: (choice index, kind, tool-call index); kinds below."""
_TEXT, _REASONING, _CALL = 0, 1, 2
"""Kinds of text: `content` (`text` outside chat), `reasoning_content`, a tool call's
`arguments`: a client reads each as a separate string, so each has its own window."""
_FIRST_TEXT: Key = (0, _TEXT, 0)
_FIRST_REASONING: Key = (0, _REASONING, 0)
_FIRST_CALL: Key = (0, _CALL, 0)
MAX_WINDOWS = 256
"""Windows one stream keeps (a client chooses `n`, and a model how many tools it calls): past
it, the windows whose tail cannot start a match are dropped (nothing is lost: a match that ends
later starts in later text); when none can be, the stream is cut as `WINDOWS_RULE`."""
WINDOWS_RULE = "stream:windows"
_OTHER_INDEX = re.compile(rb'"index":\s*[^0\s]')
"""An `index` other than 0 (a second choice, a second tool call): the events are read whole."""
_LINE = re.compile(rb"\r\n|\r|\n")
_CALL_STRING = (ARGUMENTS_KEY + b'"', ARGUMENTS_KEY + b' "')
_REASONING_STRING = (REASONING_KEY + b'"', REASONING_KEY + b' "')
"""The key with a string value (compact or `": "` spacing): SGLang sends `null` in every chunk
that has none, so the key alone says nothing; the cheaper test for the key comes first."""
_END = 32
"""/generate: characters of an index's text so far kept to tell its next text extends it."""
_NEXT = (b"a", b"\n", b" ")
"""A character of each kind an assertion tells apart (word, newline, other): `certain`."""
_FINISHED = re.compile(rb'"finish_reason":\s*["{]')
"""A finish reason that is set (SGLang sends `null` until the last chunk; /generate's is an
object)."""
_DONE_LINE = re.compile(rb"(?:^|[\r\n])data: ?\[DONE\](?:[\r\n]|$)")
_BLANK_LINE = re.compile(rb"(?:\r\n|\r(?!\n)|\n)(?:\r\n|\r|\n)")
"""Two line ends in a row, each `\\r\\n`, `\\n` or `\\r` (SSE): the end of an event."""


class StreamGuard:
    """One stream's watch: `feed` each upstream chunk, send what it returns; `finish` at the end.

    Each text of the stream (each choice's content, its reasoning, each of its tool calls'
    arguments) has its own window, as the client reassembles each on its own: with `n` > 1 or
    several tool calls their chunks interleave, and one window for all would let another
    choice's tokens split a match. The common stream, one choice with index 0, is read with a
    few regex calls; events that name another index are parsed.

    After a match, `cut` names the rule and `feed` returned the stream's final events; the relay
    then stops and aborts the upstream request."""

    __slots__ = (
        "_chat",
        "_choices",
        "_cumulative",
        "_done",
        "_ends",
        "_field",
        "_finished",
        "_held",
        "_id",
        "_model",
        "_pending",
        "_released",
        "_route",
        "_rules",
        "_seen",
        "_segments",
        "_tail",
        "_undecided",
        "_unreleased",
        "_windows",
        "cut",
    )

    def __init__(self, rules: StreamRules, route: str) -> None:
        self._rules = rules
        self._route = route
        self._cumulative = route == "/generate"
        self._field = _FIELDS[b"content" if route == "/v1/chat/completions" else b"text"]
        self._chat = route == "/v1/chat/completions"
        self._tail = b""
        self._held: list[bytes] = []
        self._windows: dict[Key, str] = {}
        self._pending: set[Key] = set()
        """Hold mode: the windows whose tail could be the start of a match."""
        self._undecided: dict[Key, str] = {}
        """Windows whose text ends with a match that an assertion at its end (`\\b`, `$`) makes
        depend on what comes next, and the rule: decided by the window's next text, or, when
        its choice or the stream ends, a match."""
        self._choices: set[int] = set()
        """Choice indices seen in parsed events (bounded): the final events end each."""
        self._done: list[int] = []
        """Choices whose last event (a `finish_reason`) the region being read holds."""
        self._finished: set[int] = set()
        """Choices whose last event the client was sent (bounded as `_choices`): the final
        events of a cut leave them as they ended."""
        self._seen: dict[int, int] = {}
        self._ends: dict[int, str] = {}
        """/generate: the last characters of each index's text so far, which a cumulative
        text repeats where its new part begins."""
        self._segments = False
        """/generate streams disjoint segments, each new text on its own (SGLang's
        `--stream-output`), not the text so far: found when one does not extend it."""
        """/generate: characters of each index's cumulative text already looked at."""
        self._unreleased: dict[int, str] = {}
        self._released: dict[int, str] = {}
        """/generate: each index's cumulative text in the last event passed on."""
        self._id: str | None = None
        self._model: str | None = None
        self.cut: str | None = None

    def feed(self, chunk: bytes) -> bytes:
        """The bytes to send now for `chunk` (b"" while they are held back)."""
        if self.cut is not None:
            return b""
        data = self._tail + chunk if self._tail else chunk
        end = data.rfind(b"\n\n") + 2  # (1: none)
        if end != len(data) and b"\r" in data:  # CR or CRLF line ends: any blank line ends one
            end = max(end, _event_end(data))
        if end < 2:
            self._tail = data
            return b""
        region, self._tail = data[:end], data[end:]
        return self._check(region)

    def finish(self) -> bytes:
        """The stream ended: a last event without its blank line is checked like any other,
        then whatever is still held goes out (or, on a match, the final events)."""
        if self.cut is not None:
            return b""
        tail, self._tail = self._tail, b""
        if tail.strip():
            tail = self._check(tail)
            if self.cut is not None:
                return tail
        if self._undecided:  # the text ended there: the match is whole
            self.cut = next(iter(self._undecided.values()))
            self._held.clear()
            return self._final()
        out = b"".join(self._held) + tail
        self._held.clear()
        return out

    def _check(self, region: bytes) -> bytes:
        """What to send for `region`, complete events: itself, with what was held, or nothing."""
        if self._id is None:
            self._learn_ids(region)
        texts = self._texts(region)
        for key, text in texts:
            rule = self._watch(key, text)
            if rule is not None:
                self.cut = rule
                self._held.clear()
                return self._final()
        if self._undecided and (rule := self._ended(region)) is not None:
            self.cut = rule
            self._held.clear()
            return self._final()
        if self._done:  # those choices will say no more: their windows cannot complete a match
            self._forget(self._done)
            self._done.clear()
        if self._pending:  # (no new text for them: a possible match is neither done nor disproved)
            self._held.append(region)
            return b""
        return self._pass(region)

    def _watch(self, key: Key, text: str) -> str | None:
        """Add `text` to `key`'s window: the rule it completes a match of, or None."""
        new = fold(text)
        if not new:
            return None
        windows = self._windows
        old = windows.get(key)
        if old is None:
            if len(windows) >= MAX_WINDOWS and not self._make_room():
                return WINDOWS_RULE
            old = ""
        window = old + new
        rules = self._rules
        undecided = self._undecided
        # a match that ends in the new text starts at most `span - 1` characters before it; an
        # undecided one, which ended where the old text did, `span` characters before it
        start = max(0, len(old) - rules.span + (key not in undecided))
        data = window.encode()
        pos = start if len(data) == len(window) else len(window[:start].encode())
        start, end = rules.pattern.Match(_UNANCHORED, data, pos, len(data))[0]
        keep = rules.span
        if start >= 0:
            if end < len(data) or rules.certain(data, pos):
                return rules.rule_at(data, start)
            undecided[key] = rules.rule_at(data, start)
            keep += 1  # and the character before it, which its start may assert on
        elif undecided:
            undecided.pop(key, None)
        windows[key] = window[-keep:]
        if rules.hold:
            if key in undecided or rules.could_start(data, pos):
                self._pending.add(key)
            elif self._pending:
                self._pending.discard(key)
        return None

    def _ended(self, region: bytes) -> str | None:
        """The rule of an undecided match whose text `region` ends (its choice's last event, or
        the stream's `[DONE]`), or None."""
        done = self._done
        if _DONE_LINE.search(region) is not None:
            return next(iter(self._undecided.values()))
        if not done and _FINISHED.search(region) is not None:  # read by the fast path: choice 0
            return next((r for key, r in self._undecided.items() if key[0] == 0), None)
        return next((rule for key, rule in self._undecided.items() if key[0] in done), None)

    def _make_room(self) -> bool:
        """Drop every window whose tail cannot start a match; False when none could go."""
        rules, pending = self._rules, self._pending
        if rules.hold:  # its partial check already ran: the pending ones are the others
            idle = [k for k in self._windows if k not in pending]
        else:
            idle = [
                k
                for k, w in self._windows.items()
                if k not in self._undecided and not rules.could_start(w.encode(), 0)
            ]
        for key in idle:
            del self._windows[key]
            self._seen.pop(key[0], None)
            self._ends.pop(key[0], None)
        return bool(idle)

    def _forget(self, choices: list[int]) -> None:
        for key in [k for k in self._windows if k[0] in choices]:
            del self._windows[key]
            self._pending.discard(key)
            self._undecided.pop(key, None)
        for choice in choices:
            self._seen.pop(choice, None)
            self._ends.pop(choice, None)

    def _pass(self, region: bytes) -> bytes:
        if self._held:
            self._held.append(region)
            region = b"".join(self._held)
            self._held.clear()
        if self._unreleased:
            self._released.update(self._unreleased)
            self._unreleased.clear()
        if _FINISHED.search(region) is not None:  # (once per choice)
            self._note_finished(region)
        return region

    def _note_finished(self, region: bytes) -> None:
        """Note the choices whose last event `region`, on its way to the client, holds."""
        for payload in _payloads(region):
            if _FINISHED.search(payload) is None or (obj := _json(payload)) is None:
                continue
            if len(self._finished) >= MAX_WINDOWS:
                return
            if self._cumulative:
                meta = obj.get("meta_info")
                if isinstance(meta, dict) and meta.get("finish_reason") is not None:
                    self._finished.add(_index(obj.get("index"), 0))
                continue
            choices = obj.get("choices")
            for position, choice in enumerate(choices if isinstance(choices, list) else ()):
                if isinstance(choice, dict) and choice.get("finish_reason") is not None:
                    self._finished.add(_index(choice.get("index"), position))

    def _texts(self, region: bytes) -> list[tuple[Key, str]]:
        """The new text of each window in `region`, in the order the events give it."""
        if self._pending or self._undecided:  # a choice's end decides those: read it whole
            return self._parsed(region)
        found = self._field.findall(region)
        calls = thinking = None
        if self._chat:  # (SGLang sends `"reasoning_content":null` in every text chunk)
            if ARGUMENTS_KEY in region and _has_string(region, _CALL_STRING):
                calls = ARGUMENTS.findall(region)
            if REASONING_KEY in region and _has_string(region, _REASONING_STRING):
                thinking = REASONING.findall(region)
        if not (found or calls or thinking):
            return []
        if _OTHER_INDEX.search(region) is not None:
            return self._parsed(region)
        if self._cumulative:  # (several events' texts: each in turn, segments or not)
            return [(_FIRST_TEXT, "".join(self._new_part(0, _decode(m)) for m in found))]
        if len(found) == 1 and not (calls or thinking):  # the usual chunk: one event's text
            return [(_FIRST_TEXT, _decode(found[0]))]
        return self._scanned(region, found, calls, thinking)

    def _scanned(
        self,
        region: bytes,
        found: list[bytes] | None = None,
        calls: list[bytes] | None = None,
        thinking: list[bytes] | None = None,
    ) -> list[tuple[Key, str]]:
        """The texts the field regexes find in `region`, as the first choice's."""
        if found is None:
            if self._cumulative:
                return []
            found = self._field.findall(region)
            if self._chat:
                calls, thinking = ARGUMENTS.findall(region), REASONING.findall(region)
        texts = []
        if found:
            texts.append((_FIRST_TEXT, "".join(_decode(m) for m in found if m)))
        if thinking:
            texts.append((_FIRST_REASONING, "".join(_decode(m) for m in thinking if m)))
        if calls:
            texts.append((_FIRST_CALL, "".join(_decode(m) for m in calls if m)))
        return texts

    def _parsed(self, region: bytes) -> list[tuple[Key, str]]:
        """`_texts` for events that need their structure (several choices or tool calls)."""
        texts: dict[Key, list[str]] = {}
        for payload in _payloads(region):
            obj = _json(payload)
            if obj is None:  # not JSON: read as the fast path reads it, the first choice's
                for key, text in self._scanned(payload):
                    _add(texts, key, text)
                continue
            if self._cumulative:
                index = _index(obj.get("index"), 0)
                self._note(index)
                if isinstance(whole := obj.get("text"), str):
                    _add(texts, (index, _TEXT, 0), self._new_part(index, whole))
                meta = obj.get("meta_info")
                if isinstance(meta, dict) and meta.get("finish_reason") is not None:
                    self._done.append(index)
                continue
            choices = obj.get("choices")
            for position, choice in enumerate(choices if isinstance(choices, list) else ()):
                if isinstance(choice, dict):
                    self._read_choice(texts, _index(choice.get("index"), position), choice)
        return [(key, "".join(parts)) for key, parts in texts.items()]

    def _read_choice(self, texts: dict[Key, list[str]], index: int, choice: dict[str, Any]) -> None:
        self._note(index)
        if not self._chat:
            _add(texts, (index, _TEXT, 0), choice.get("text"))
        elif isinstance(delta := choice.get("delta") or choice.get("message"), dict):
            _add(texts, (index, _TEXT, 0), delta.get("content"))
            _add(texts, (index, _REASONING, 0), delta.get("reasoning_content"))
            calls = delta.get("tool_calls")
            for position, call in enumerate(calls if isinstance(calls, list) else ()):
                if isinstance(call, dict) and isinstance(function := call.get("function"), dict):
                    key = (index, _CALL, _index(call.get("index"), position))
                    _add(texts, key, function.get("arguments"))
            if isinstance(legacy := delta.get("function_call"), dict):
                _add(texts, (index, _CALL, 0), legacy.get("arguments"))
        if choice.get("finish_reason") is not None:
            self._done.append(index)

    def _note(self, index: int) -> None:
        if len(self._choices) < MAX_WINDOWS:
            self._choices.add(index)

    def _new_part(self, index: int, whole: str) -> str:
        """/generate: what `whole`, an index's cumulative text, adds to what was looked at; all
        of it once the stream is found to send segments."""
        if self._segments:
            return whole
        seen = self._seen.get(index, 0)
        end = self._ends.get(index, "")
        if seen and (len(whole) < seen or whole[seen - len(end) : seen] != end):
            # not the text so far, extended: a segment (and so is every later event's text);
            # the final events then add no text, as a segment of their own
            self._segments = True
            for part in (self._seen, self._ends, self._unreleased, self._released):
                part.clear()
            return whole
        if len(whole) > seen:  # (then it gets a window, and all three are dropped together)
            self._seen[index] = len(whole)
            self._ends[index] = whole[-_END:]
        if index == 0 or index in self._choices:  # the final events' texts: bounded as those are
            self._unreleased[index] = whole
        return whole[seen:]

    def _learn_ids(self, region: bytes) -> None:
        found = _ID.search(region)
        if found is not None:
            self._id = found.group(1).decode("utf-8", "replace")
        model = _MODEL.search(region)
        if model is not None:
            self._model = model.group(1).decode("utf-8", "replace")

    def _final(self) -> bytes:
        """The stream's last events: one per choice the client has not seen finish (a choice
        that finished keeps its own `finish_reason`)."""
        if not self._choices - {0}:
            return final_events(self._route, self._id, self._model, self._released.get(0, ""))
        choices = self._choices | {0}
        left = choices - self._finished or choices
        released = self._released
        ended = {index: released.get(index, "") for index in left}
        return final_events(self._route, self._id, self._model, choices=ended)


def _has_string(region: bytes, forms: tuple[bytes, bytes]) -> bool:
    return forms[0] in region or forms[1] in region


def _event_end(data: bytes) -> int:
    """Where the last complete event in `data` ends (0: none)."""
    end = 0
    for blank in _BLANK_LINE.finditer(data):
        end = blank.end()
    return end


def _payloads(region: bytes) -> Iterator[bytes]:
    """The `data` of each event in `region` (its `data:` lines joined), `[DONE]` left out."""
    data: list[bytes] = []
    for line in [*_LINE.split(region), b""]:
        if not line:
            if data:
                payload = b"\n".join(data)
                if payload != b"[DONE]":
                    yield payload
                data = []
        elif line.startswith(b"data:"):
            data.append(line[6:] if line.startswith(b"data: ") else line[5:])


def _json(payload: bytes) -> dict[str, Any] | None:
    try:
        obj = orjson.loads(payload)
    except orjson.JSONDecodeError:
        try:  # Python's json writes NaN and Infinity (a logprob of -inf), which orjson refuses
            obj = json.loads(payload)
        except ValueError:
            return None
    return obj if isinstance(obj, dict) else None


def _index(value: object, default: int) -> int:
    return (
        value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else default
    )


def _add(texts: dict[Key, list[str]], key: Key, text: object) -> None:
    if isinstance(text, str) and text:
        texts.setdefault(key, []).append(text)


# ---------------------------------------------------------------------------------------------
# Patterns: RE2 (linear time), with a second expression for "could this be a match's start".
#
# RE2 has no partial matching, so hold mode asks another RE2 expression, built from the rule
# patterns, whether the window's tail is a non-empty prefix of some match: `prefix(p)` matches
# exactly the prefixes of the strings `p` matches (the empty string included). Building it takes
# the pattern's structure (sequence, alternation, repetition); every atom (a character, a class,
# an escape, an assertion) is copied verbatim from the source, so it keeps RE2's meaning.

_OPTIONS = re2.Options()
_OPTIONS.case_sensitive = False
_OPTIONS.log_errors = False
_OPTIONS.never_capture = True  # one span per search; user groups cost nothing and never clash
_UNANCHORED = re2._Anchor.UNANCHORED
_ANCHOR_START = re2._Anchor.ANCHOR_START
_NO_SPAN = (-1, -1)
_UNBOUNDED = 1 << 30
_FLAG_DEFAULTS = {"i": True, "m": False, "s": False}
"""The flags an atom is read with unless the pattern changes them (case-insensitive: the rules
are compiled so); `U` (ungreedy) changes which match is found, not whether one is."""
_REPEAT = re.compile(r"\{(\d+)(?:(,)(\d*))?\}")
_PERL_CLASS = frozenset("dDsSwW")
_ASSERTION = frozenset("bBAz")
_CONTROL = {"a": "\\a", "f": "\\f", "t": "\\t", "n": "\\n", "r": "\\r", "v": "\\v"}


@dataclass(frozen=True, slots=True)
class _Atom:
    source: str
    """RE2 text that matches one character (or, width 0, an assertion such as `\\b`)."""
    width: int


@dataclass(frozen=True, slots=True)
class _Seq:
    items: tuple[_Node, ...]


@dataclass(frozen=True, slots=True)
class _Alt:
    branches: tuple[_Node, ...]


@dataclass(frozen=True, slots=True)
class _Repeat:
    node: _Node
    low: int
    high: int | None
    """None: unbounded."""


_Node = _Atom | _Seq | _Alt | _Repeat


class _Parser:
    """RE2 syntax (https://github.com/google/re2/wiki/Syntax) into `_Node`s. Only patterns RE2
    has already accepted come here, so this reads structure and does not re-check it."""

    def __init__(self, pattern: str) -> None:
        self.s = pattern
        self.i = 0
        self.flags = dict(_FLAG_DEFAULTS)

    def parse(self) -> _Node:
        node = self._alternation()
        if self.i != len(self.s):
            raise ValueError(f"unexpected {self.s[self.i]!r} at {self.i}")
        return node

    def _alternation(self) -> _Node:
        branches = [self._sequence()]
        while self.s.startswith("|", self.i):
            self.i += 1
            branches.append(self._sequence())
        return branches[0] if len(branches) == 1 else _Alt(tuple(branches))

    def _sequence(self) -> _Node:
        items: list[_Node] = []
        s = self.s
        while self.i < len(s) and s[self.i] not in "|)":
            node = self._item(items)
            if node is not None:
                items.append(self._repeats(node))
        return items[0] if len(items) == 1 else _Seq(tuple(items))

    def _repeats(self, node: _Node) -> _Node:
        s = self.s
        while self.i < len(s):
            c = s[self.i]
            if c in "*+?":
                low, high = (0, None) if c == "*" else (1, None) if c == "+" else (0, 1)
                self.i += 1
            elif c == "{" and (m := _REPEAT.match(s, self.i)) is not None:
                low = int(m.group(1))
                high = low if m.group(2) is None else int(m.group(3)) if m.group(3) else None
                self.i = m.end()
            else:
                return node
            if self.s.startswith("?", self.i):  # lazy: the same strings
                self.i += 1
            node = _Repeat(node, low, high)
        return node

    def _atom(self, source: str, width: int = 1) -> _Atom:
        flags = self.flags
        if flags == _FLAG_DEFAULTS:
            return _Atom(source, width)
        on = "".join(f for f, v in flags.items() if v)
        off = "".join(f for f, v in flags.items() if not v)
        return _Atom(f"(?{on}-{off}:{source})" if off else f"(?{on}:{source})", width)

    def _literal(self, char: str) -> _Atom:
        return self._atom(char if char.isalnum() or ord(char) > 127 else f"\\x{{{ord(char):x}}}")

    def _item(self, items: list[_Node]) -> _Node | None:
        s, i = self.s, self.i
        c = s[i]
        if c == "(":
            return self._group()
        if c == "[":
            end = _class_end(s, i)
            self.i = end
            return self._atom(s[i:end])
        if c == ".":
            self.i += 1
            return self._atom(".")
        if c in "^$":
            self.i += 1
            return self._atom(c, 0)
        if c in "*+?":
            raise ValueError(f"nothing to repeat at {i}")
        if c != "\\":
            self.i += 1
            return self._literal(c)
        if i + 1 >= len(s):
            raise ValueError("trailing backslash")
        e = s[i + 1]
        if e == "Q":  # \Q...\E: literal text; a repetition after it takes its last character
            end = s.find("\\E", i + 2)
            text = s[i + 2 :] if end < 0 else s[i + 2 : end]
            self.i = len(s) if end < 0 else end + 2
            if not text:
                return None
            items.extend(self._literal(ch) for ch in text[:-1])
            return self._literal(text[-1])
        if e in "pP" or e == "x":
            if s.startswith("{", i + 2):
                close = s.find("}", i + 2)
                if close < 0:
                    raise ValueError(f"unterminated \\{e}{{ at {i}")
                self.i = close + 1
            else:
                self.i = i + 3 if e in "pP" else i + 4
            return self._atom(s[i : self.i])
        if e in "01234567":
            j = i + 2
            while j < len(s) and j < i + 4 and s[j] in "01234567":
                j += 1
            self.i = j
            return self._atom(s[i:j])
        self.i = i + 2
        if e in _ASSERTION:
            return self._atom(s[i : i + 2], 0)
        if e in _PERL_CLASS or e == "C" or e in _CONTROL:
            return self._atom(s[i : i + 2])
        if e.isalnum():
            raise ValueError(f"unknown escape \\{e}")
        return self._literal(e)

    def _group(self) -> _Node | None:
        s = self.s
        saved = dict(self.flags)
        if s.startswith("(?", self.i):
            j = self.i + 2
            if s.startswith("P<", j) or (
                s.startswith("<", j) and not s.startswith(("<=", "<!"), j)
            ):
                close = s.find(">", j)
                if close < 0:
                    raise ValueError(f"unterminated group name at {self.i}")
                self.i = close + 1
            else:
                k = j
                while k < len(s) and s[k] not in ":)":
                    k += 1
                if k >= len(s):
                    raise ValueError(f"unterminated group at {self.i}")
                on = True
                for f in s[j:k]:
                    if f == "-":
                        on = False
                    elif f in self.flags:
                        self.flags[f] = on
                    elif f != "U":
                        raise ValueError(f"unknown flag {f!r}")
                self.i = k + 1
                if s[k] == ")":  # (?flags): for the rest of the enclosing group
                    return None
        else:
            self.i += 1
        node = self._alternation()
        if not s.startswith(")", self.i):
            raise ValueError("missing )")
        self.i += 1
        self.flags = saved
        return node


def _class_end(s: str, i: int) -> int:
    """The index after the `]` that closes the class opened at `s[i]`."""
    j = i + 1
    if s.startswith("^", j):
        j += 1
    if s.startswith("]", j):  # a `]` first is a literal
        j += 1
    while j < len(s):
        c = s[j]
        if c == "]":
            return j + 1
        if c == "\\":
            j += 2
        elif s.startswith("[:", j) and (close := s.find(":]", j + 2)) >= 0:
            j = close + 2
        else:
            j += 1
    raise ValueError(f"missing ] for the class at {i}")


def _emit(node: _Node) -> str:
    """RE2 text for `node`."""
    if isinstance(node, _Atom):
        return node.source
    if isinstance(node, _Seq):
        return "".join(_group(_emit(x)) if isinstance(x, _Alt) else _emit(x) for x in node.items)
    if isinstance(node, _Alt):
        return "|".join(_emit(b) for b in node.branches)
    high = "" if node.high is None else str(node.high)
    return f"(?:{_emit(node.node)}){{{node.low},{high}}}"


def _prefix(node: _Node) -> str:
    """RE2 text that matches every prefix (the empty one included) of what `node` matches."""
    if isinstance(node, _Atom):
        return f"(?:{node.source})?"
    if isinstance(node, _Seq):
        # prefix(x1 x2 ... xn) = prefix(x1) | x1 prefix(x2 ... xn), nested from the right;
        # written front to back, so a long literal costs linear time to build
        opens, closes = [], []
        for x in node.items:
            if isinstance(x, _Atom):  # prefix(x) is "x or nothing"
                opens.append(f"(?:{x.source}")
                closes.append(")?")
            else:
                opens.append(f"(?:{_prefix(x)}|{_group(_emit(x))}")
                closes.append(")")
        return "".join(opens) + "".join(reversed(closes))
    if isinstance(node, _Alt):
        return "(?:" + "|".join(_prefix(b) for b in node.branches) + ")"
    # prefix(x{low,high}) = x{0,high-1} prefix(x): fewer copies may still be followed by more
    if node.high == 0:
        return ""
    whole = _group(_emit(node.node))
    before = "*" if node.high is None else f"{{0,{node.high - 1}}}"
    return f"(?:{whole}{before}{_prefix(node.node)})"


def _group(source: str) -> str:
    return f"(?:{source})"


def _widths(node: _Node) -> tuple[int, int]:
    """The fewest and the most characters a match of `node` spans (`_UNBOUNDED` at most)."""
    if isinstance(node, _Atom):
        return node.width, node.width
    if isinstance(node, _Seq):
        pairs = [_widths(x) for x in node.items]
        return sum(p[0] for p in pairs), min(_UNBOUNDED, sum(p[1] for p in pairs))
    if isinstance(node, _Alt):
        pairs = [_widths(x) for x in node.branches]
        return min(p[0] for p in pairs), max(p[1] for p in pairs)
    low, high = _widths(node.node)
    most = _UNBOUNDED if node.high is None and high else high * (node.high or 0)
    return min(_UNBOUNDED, low * node.low), min(_UNBOUNDED, most)


def _source(pattern: str, literal: bool) -> str:
    return re2.escape(pattern) if literal else pattern


def _node(pattern: str, literal: bool) -> _Node:
    if literal:
        return _Seq(tuple(_Atom(re2.escape(c), 1) for c in pattern))
    return _Parser(pattern).parse()


def _compile(source: str) -> Any:
    compiled = re2._re2.RE2(source.encode(), _OPTIONS)
    if not compiled.ok():
        raise ValueError(compiled.error().decode(errors="replace"))
    return compiled


def final_events(
    route: str,
    response_id: str | None,
    model: str | None,
    generated: str = "",
    *,
    choices: Mapping[int, str] | None = None,
) -> bytes:
    """A stream's last chunk with `finish_reason: "content_filter"`, then `data: [DONE]`.

    `choices`: a stream of several choices (`n` > 1) ends each, index by index (the values are
    /generate's text of each); without it, the one choice, index 0, with `generated`."""
    rid = response_id or "policy"
    if not choices:
        return _final_event(route, rid, model, generated, None) + b"data: [DONE]\n\n"
    events = [_final_event(route, rid, model, text, i) for i, text in sorted(choices.items())]
    return b"".join(events) + b"data: [DONE]\n\n"


def _final_event(
    route: str, rid: str, model: str | None, generated: str, index: int | None
) -> bytes:
    if route == "/generate":
        obj: dict[str, object] = {
            "text": generated,
            "meta_info": {"id": rid, "finish_reason": {"type": "content_filter"}},
        }
        if index is not None:
            obj["index"] = index
    elif route == "/v1/chat/completions":
        obj = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": model or "",
            "choices": [{"index": index or 0, "delta": {}, "finish_reason": "content_filter"}],
        }
    else:
        obj = {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": model or "",
            "choices": [{"index": index or 0, "text": "", "finish_reason": "content_filter"}],
        }
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _decode(escaped: bytes) -> str:
    if b"\\" not in escaped:  # no escape: the JSON string's body is the text itself, in UTF-8
        return escaped.decode("utf-8", "replace")
    try:
        text = orjson.loads(b'"' + escaped + b'"')
    except orjson.JSONDecodeError:
        return escaped.decode("utf-8", "replace")
    return text if isinstance(text, str) else ""


__all__ = [
    "MAX_WINDOWS",
    "WINDOWS_RULE",
    "StreamGuard",
    "StreamRules",
    "check_pattern",
    "final_events",
]
