"""Hot prefixes: a bounded, decaying count of the prompt prefixes the edge routes, per model.

Each routed request adds one (decayed) count to every whole block of its prefix chain
(`prefix_blocks`): a system prompt, a few-shot block or a long shared document is counted by
every request that starts with it, a request's own tail only once. Counts decay exponentially
with `half_life_s`, done the cheap way: a count added at time t weighs 2^(t / half_life), so old
counts need no update (weights are rescaled when they grow large). Each model keeps at most
`capacity` entries; past twice that, the lowest-scored half is dropped at once, so the cost of
pruning is amortised to O(log capacity) per new entry. An entry keeps a reference to the text of
the request that created it (no copy), and for a chat request to its messages (less their content
parts that are not text, which the hashes never covered); the prefix is cut from them only when
it is warmed. A prompt that runs on for more than `KEEP_PAST` characters
past its hashed blocks (`max_blocks` of them) is cut to those first, once per request that adds
an entry, so that entries never keep long prompts alive for the part past them (otherwise up
to 2 × `capacity` prompts of `max_body_bytes` each); shorter ones are kept as they are, at no cost.

`top(model, n)` gives the deepest hot prefix of each lineage (an entry whose deeper block is
also hot is covered by it), hottest first: what pre-warming sends.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from backends.backend import Backend
from edge.routing.prefix_blocks import PrefixBlocks
from edge.stages.view import chat_prefix

_RESCALE_AT = 2.0**40
KEEP_PAST = 16 * 1024
"""Characters past the hashed blocks an entry may keep alive rather than cut the prompt."""


@dataclass(frozen=True, slots=True)
class HotPrefix:
    model: str
    text: str
    """The prefix itself (whole blocks)."""
    key: int
    """The hash of its deepest block."""
    count: float
    """Decayed count, in requests (one request now counts 1)."""
    messages: list[dict[str, Any]] | None = None
    """Chat: the conversation cut where the prefix ends (`chat_prefix`); None otherwise."""
    tools: list[Any] | None = None
    """Chat: the tools the requests offered (the start of the prefix), sent with `messages`."""
    token_ids: bool = False
    """The requests' prompts were token ids: `text` is them in decimal, joined by spaces (its
    last number perhaps cut short by the block boundary)."""

    def cut(self, chars: int) -> list[dict[str, Any]] | None:
        """The conversation up to the prefix's first `chars` characters (a warm-up shard)."""
        return None if self.messages is None else chat_prefix(self.messages, chars, self.tools)


class _Entry:
    __slots__ = ("end", "ids", "messages", "parent", "score", "source", "tools")

    def __init__(
        self,
        source: str,
        end: int,
        parent: int | None,
        score: float,
        messages: list[dict[str, Any]] | None,
        tools: list[Any] | None,
        ids: bool = False,
    ) -> None:
        self.ids = ids
        self.source = source
        self.end = end
        self.parent = parent
        self.score = score
        self.messages = messages
        self.tools = tools


def _text_only(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` less their content parts that are not text (images, audio): the blocks are
    hashed from the text alone, so the cut past them never sees such parts, and an entry would
    keep its request's images alive (up to `max_body_bytes` each). The list itself when it has
    none (no copy)."""
    out: list[dict[str, Any]] | None = None
    for i, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, list) and any(
            not isinstance(part, dict) or part.get("type") != "text" for part in content
        ):
            if out is None:
                out = messages[:i]
            text = [
                part if part.get("type") == "text" else {"type": "text", "text": part["text"]}
                for part in content
                if isinstance(part, dict) and isinstance(part.get("text"), str)
            ]
            out.append({**m, "content": text})
        elif out is not None:
            out.append(m)
    return messages if out is None else out


def model_of(view_model: str | None, candidates: Sequence[Backend]) -> str | None:
    """The model a routed prompt is counted under: its candidates' pool (they are always one
    pool's, and a backend is warmed with its own pool's prefixes), else the name the request
    gave (no backend's model is known yet)."""
    for b in candidates:
        if b.model is not None:
            return b.model
    return view_model


class HotPrefixes:
    def __init__(
        self,
        *,
        capacity: int = 256,
        half_life_s: float = 60.0,
        max_models: int = 64,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        if not half_life_s > 0:
            raise ValueError("half_life_s must be > 0")
        self.capacity = capacity
        self.half_life_s = half_life_s
        self.max_models = max_models
        self._clock = clock
        self._origin = clock()
        self._models: dict[str, dict[int, _Entry]] = {}

    def _weight(self) -> float:
        w = 2.0 ** ((self._clock() - self._origin) / self.half_life_s)
        if w > _RESCALE_AT:  # keep the numbers in range: rebase every score on now
            for entries in self._models.values():
                for e in entries.values():
                    e.score /= w
            self._origin = self._clock()
            w = 1.0
        return w

    def record(
        self,
        model: str | None,
        blocks: PrefixBlocks,
        messages: list[dict[str, Any]] | None = None,
        tools: list[Any] | None = None,
        *,
        token_ids: bool = False,
    ) -> None:
        """Count one routed request (`messages`, `tools`: a chat request's, which `blocks` were
        hashed from; `token_ids`: its prompt was token ids, `blocks` hashed from them in decimal).
        Cheap: a dict update per whole block of its prompt."""
        hashes = blocks.hashes
        if not hashes:
            return
        name = model or ""
        entries = self._models.get(name)
        if entries is None:
            if len(self._models) >= self.max_models:  # one model too many: forget the smallest
                smallest = min(self._models, key=lambda m: len(self._models[m]))
                del self._models[smallest]
            entries = self._models[name] = {}
        w = self._weight()
        parent: int | None = None
        size = blocks.block_chars
        source, span = blocks.text, len(hashes) * size
        get = entries.get
        bare = messages is None  # the messages hold nothing but the hashed text
        for k, h in enumerate(hashes):
            e = get(h)
            if e is None:
                if len(source) > span + KEEP_PAST:  # keep what the hashes cover, no more
                    source = source[:span]
                    messages = None if messages is None else chat_prefix(messages, span, tools)
                if not bare:
                    assert messages is not None
                    messages, bare = _text_only(messages), True
                entries[h] = _Entry(source, (k + 1) * size, parent, w, messages, tools, token_ids)
            else:
                e.score += w
            parent = h
        if len(entries) > 2 * self.capacity:
            keep = sorted(entries.items(), key=lambda kv: kv[1].score, reverse=True)
            self._models[name] = dict(keep[: self.capacity])

    def count(self, model: str | None, key: int) -> float:
        e = self._models.get(model or "", {}).get(key)
        return 0.0 if e is None else e.score / self._weight()

    def top(self, model: str | None, n: int, *, min_count: float = 2.0) -> list[HotPrefix]:
        """Up to `n` hot prefixes of `model` (None: every model), deepest per lineage, hottest
        first; only those counted at least `min_count` (decayed) times."""
        w = self._weight()
        names = list(self._models) if model is None else [model]
        out: list[HotPrefix] = []
        floor = min_count * w
        for name in names:
            entries = self._models.get(name)
            if not entries:
                continue
            hot = {h: e for h, e in entries.items() if e.score >= floor}
            covered: set[int] = set()
            for e in hot.values():
                p = e.parent
                while p is not None and p not in covered:
                    covered.add(p)
                    parent = entries.get(p)
                    p = parent.parent if parent is not None else None
            for h, e in hot.items():
                if h not in covered:
                    cut = None if e.messages is None else chat_prefix(e.messages, e.end, e.tools)
                    text = e.source[: e.end]
                    out.append(HotPrefix(name, text, h, e.score / w, cut, e.tools, e.ids))
        out.sort(key=lambda p: p.count, reverse=True)
        return out[:n]

    def models(self) -> list[str]:
        return list(self._models)

    def __len__(self) -> int:
        return sum(len(e) for e in self._models.values())

    def snapshot(self, n: int = 8, *, min_count: float = 2.0) -> list[dict[str, object]]:
        """The hot prefixes for the admin JSON (length, count and first characters)."""
        return [
            {"model": p.model or None, "chars": len(p.text), "count": round(p.count, 2),
             "key": f"{p.key:016x}", "head": p.text[:48]}
            for p in self.top(None, n, min_count=min_count)
        ]  # fmt: skip


__all__ = ["KEEP_PAST", "HotPrefix", "HotPrefixes", "model_of"]
