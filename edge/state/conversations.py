"""Stored conversations: the edge keeps each conversation's messages, the client sends one turn.

Two conventions reach the same store:

- `/v1/responses` with `previous_response_id` / `store` (OpenAI's Responses API), translated to
  an upstream `/v1/chat/completions` request by `edge.state.responses`;
- `/v1/chat/completions` with the header `x-quicedge-conversation: new` (start one) or
  `x-quicedge-conversation: conv_…` (continue it); `messages` then holds only the new turn.

Either way the edge rebuilds the whole prompt and forwards an ordinary request, so backends see
nothing new. The history is serialised the same way every turn (the stored message objects, in
order, by one JSON encoder), so turn N+1's prompt starts with turn N's prompt and reply byte for
byte, and the backend's radix cache and the `ttft` policy's prefix tree both hit.

Safety: keys carry the tenant, so another tenant's id is simply not found (404, like an unknown or
expired id). A turn holds a lease on its conversation (`SET NX PX` in Redis) from before it reads
the history until it commits the reply; a second turn meanwhile gets 409 `conversation_busy`, and a
commit is written only while its lease still holds (a Lua compare-and-set), so a history is never
interleaved. The reply is appended only when its stream completed; a failed or cut turn leaves the
conversation as it was.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson
from cachetools import TTLCache

from edge.errors import ConversationBusy, ConversationNotFound, PayloadTooLarge, StateUnavailable
from edge.state.config import ConversationConfig
from edge.state.redis_store import RedisState, Share, Unreadable, warn_unreadable

CONVERSATION_HEADER = "x-quicedge-conversation"
NEW = "new"
_CONV_ID = re.compile(r"conv_([0-9a-f]{24})")
_RESP_ID = re.compile(r"resp_([0-9a-f]{24})([0-9a-f]{8})")
_PINNED_ROLES = ("system", "developer")  # a tuple: a client's role may be unhashable
REMOVED = "x_quicedge_removed"
"""Marks a stored message, or one tool call of it, that `DELETE /v1/conversations/{id}/items/
{item}` took out: its content is gone, its place stays, so every other item keeps its id (ids
are places). Prompts and item lists leave it out."""


BUSY = (
    "another request holds this conversation's lease: a turn or change of it is in progress; "
    "retry when it completed"
)
"""The 409's message. A lease left behind by a request that failed while Redis did not answer
is released once Redis answers again, so a 409 means a request really holds it."""


def new_conversation_id() -> str:
    return os.urandom(12).hex()


def conversation_name(cid: str) -> str:
    """The id a chat client sees (`conv_` + 24 hex digits)."""
    return f"conv_{cid}"


def response_id(cid: str, turn: int) -> str:
    """A Responses API id that names its conversation and turn (`resp_` + 32 hex digits)."""
    return f"resp_{cid}{turn:08x}"


def parse_conversation_name(value: str) -> str:
    """The conversation in `conv_…`; 404 for anything else (a malformed id exists nowhere)."""
    match = _CONV_ID.fullmatch(value)
    if match is None:
        raise ConversationNotFound(
            f"Conversation with id '{value[:80]}' not found.", param=CONVERSATION_HEADER
        )
    return match.group(1)


def parse_response_id(value: str) -> tuple[str, int]:
    """(conversation, turn) of a response id; 404 `previous_response_not_found` otherwise."""
    match = _RESP_ID.fullmatch(value)
    if match is None:
        raise previous_not_found(value)
    return match.group(1), int(match.group(2), 16)


def previous_not_found(value: str) -> ConversationNotFound:
    return ConversationNotFound(
        f"Previous response with id '{value[:80]}' not found.",
        param="previous_response_id",
        code="previous_response_not_found",
    )


@dataclass(slots=True)
class History:
    """One conversation as stored: pinned system messages, then whole turns.

    `turns[i]` is where kept turn i ends in `messages`; turns are numbered from 1, and the kept
    ones are `count - len(turns) + 1 .. count` (truncation drops the oldest)."""

    pinned: list[dict[str, Any]] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    turns: list[int] = field(default_factory=list)
    count: int = 0
    meta: list[dict[str, Any]] = field(default_factory=list)
    """Per kept turn, what `GET /v1/responses/{id}` gives back besides the reply's text (its
    time, model, usage, status and echoed fields); `{}` for a chat conversation's turn. Never
    part of the prompt."""
    created_at: int = 0
    """When the conversation started (Unix seconds; 0 when stored before this was kept)."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """The `metadata` it was created with (`POST /v1/conversations`), or set since."""
    pending: list[dict[str, Any]] = field(default_factory=list)
    """Items added since the latest turn (`POST /v1/conversations/{id}/items`): they lead the
    next turn's new messages, and become part of it when it is stored."""
    removed: int = 0
    """How many items were taken out (`REMOVED`); while 0, a prompt is the stored messages as
    they are, with no pass over them to leave any out."""
    stored: int = 0
    """Bytes of the value it was read from (0: not read from the store); never stored."""

    def encode(self) -> bytes:
        # Each turn's echoed request fields are kept apart ("e"), only those that differ from
        # the turn before's: the same tools and instructions sent every turn are kept once.
        meta: list[dict[str, Any]] = []
        echoes: list[list[Any] | None] = []
        before: dict[str, Any] | None = None
        for entry in self.meta:
            echo = entry.get("echo")
            if isinstance(echo, dict):
                meta.append({k: v for k, v in entry.items() if k != "echo"})
                echoes.append(_echo_items(echo, before))
                before = echo
            else:
                meta.append(entry)
                echoes.append(None)
                before = None
        return orjson.dumps(
            {"p": self.pinned, "m": self.messages, "t": self.turns, "c": self.count,
             "u": meta, "e": echoes, "s": self.created_at, "d": self.metadata,
             "q": self.pending, "r": self.removed}
        )  # fmt: skip

    @classmethod
    def decode(cls, blob: bytes) -> History:
        """A stored history; `Unreadable` for a value of any other shape (checked whole here,
        so nothing later meets a part of the wrong type)."""
        try:
            obj = orjson.loads(blob)
        except orjson.JSONDecodeError as exc:
            raise Unreadable(f"not JSON: {exc}") from None
        if not isinstance(obj, dict):
            raise Unreadable("not a JSON object")
        get: Callable[[str], Any] = obj.get
        pinned, messages, turns, count = get("p"), get("m"), get("t"), get("c")
        meta = get("u") or []  # a blob stored before turns kept theirs
        metadata, pending, created, removed = get("d") or {}, get("q") or [], get("s"), get("r")
        created, removed = created or 0, removed or 0
        if not (
            _objects(pinned) and _objects(messages) and _objects(meta) and _objects(pending)
            and isinstance(turns, list) and all(type(t) is int for t in turns)
            and all(0 < a <= b for a, b in zip([1, *turns], turns, strict=False))
            and (not turns or turns[-1] <= len(messages))
            and type(count) is int and count >= len(turns) and len(meta) <= len(turns)
            and isinstance(metadata, dict) and type(removed) is int
            and type(created) in (int, float)
        ):  # fmt: skip
            raise Unreadable("not a stored conversation")
        echoes = get("e")
        if echoes is not None:  # a blob stored before echoes were kept apart has none
            meta = _with_echoes(meta, echoes)
        return cls(pinned, messages, turns, count, [{}] * (len(turns) - len(meta)) + meta,
                   int(created), metadata, pending, removed, len(blob))  # fmt: skip

    def copy(self) -> History:
        return History(
            list(self.pinned),
            list(self.messages),
            list(self.turns),
            self.count,
            list(self.meta),
            self.created_at,
            dict(self.metadata),
            list(self.pending),
            self.removed,
        )

    def items(self) -> list[tuple[str, dict[str, Any]]]:
        """Every kept message with its place: (`TTTTTTTTJJJJ`, message), turn `T` (0 for the
        pinned ones) and index `J` within it, in hex; stable when older turns are dropped."""
        out = [(f"{0:08x}{j:04x}", m) for j, m in enumerate(self.pinned)]
        start = 0
        for k, end in enumerate(self.turns):
            turn = self.first_kept + k
            out += [(f"{turn:08x}{j:04x}", m) for j, m in enumerate(self.messages[start:end])]
            start = end
        # where the next turn will keep them, so their ids stay when it does
        return out + [(f"{self.count + 1:08x}{j:04x}", m) for j, m in enumerate(self.pending)]

    def turn_input(self, turn: int) -> list[tuple[str, dict[str, Any]]] | None:
        """The messages turn `turn` sent (its reply left out; turn 1 with the pinned ones), as
        `items` places them; None when it is not kept."""
        if not self.first_kept <= turn <= self.count:
            return None
        k = turn - self.first_kept
        start = self.turns[k - 1] if k else 0
        sent = self.messages[start : self.turns[k] - 1]
        lead = [(f"{0:08x}{j:04x}", m) for j, m in enumerate(self.pinned)] if turn == 1 else []
        return lead + [(f"{turn:08x}{j:04x}", m) for j, m in enumerate(sent)]

    def next_input(self, new: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
        """What the next turn sends, placed as `turn_input` will place it once that turn is
        stored (the first turn's leading system messages join the pinned ones)."""
        turn, lead = self.count + 1, 0
        if self.count == 0 and not self.messages:
            while lead < len(new) and new[lead].get("role") in _PINNED_ROLES:
                lead += 1
        pinned = [*self.pinned, *new[:lead]] if turn == 1 else []
        placed = [(f"{0:08x}{j:04x}", m) for j, m in enumerate(pinned)]
        return placed + [(f"{turn:08x}{j:04x}", m) for j, m in enumerate(new[lead:])]

    def reply(self, turn: int) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """Turn `turn`'s reply (the assistant message) and metadata; None when it is not kept
        (or not a turn)."""
        if not self.first_kept <= turn <= self.count:
            return None
        kept = turn - self.first_kept
        return self.messages[self.turns[kept] - 1], self.meta[kept]

    @property
    def first_kept(self) -> int:
        return self.count - len(self.turns) + 1

    def upto(self, turn: int) -> History | None:
        """The history as it was after `turn` (None when truncation dropped it)."""
        if turn == self.count:
            return self
        if not self.first_kept <= turn < self.count:
            return None
        kept = turn - self.first_kept + 1
        end = self.turns[kept - 1]
        return History(
            list(self.pinned),
            self.messages[:end],
            self.turns[:kept],
            turn,
            self.meta[:kept],
            self.created_at,
            dict(self.metadata),
            removed=self.removed,
        )

    def prompt(self, new: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if not self.removed:
            return [*self.pinned, *self.messages, *new]
        shown = map(_without_removed, [*self.pinned, *self.messages, *new])
        return [m for m in shown if m is not None]

    def remove(self, message: dict[str, Any], call: int | None = None) -> None:
        """Take out a stored message's `call`-th tool call, or (None) its text; a message left
        with neither is taken out whole (role kept, content gone)."""
        calls = message.get("tool_calls")
        calls = [c for c in calls if isinstance(c, dict)] if isinstance(calls, list) else []
        if call is None:
            message["content"] = None
        else:
            # numbered as `calls_of` numbers them; the mark stays well-formed, so the calls
            # after it keep their numbers
            formed = [c for c in calls if isinstance(c.get("function"), dict)]
            formed[call].clear()
            formed[call].update({"type": "function", "function": {"name": "", "arguments": ""},
                                 REMOVED: True})  # fmt: skip
        if not (message.get("content") or any(not c.get(REMOVED) for c in calls)):
            role = message.get("role")
            message.clear()
            message.update({"role": role, REMOVED: True})
        self.removed += 1

    def append(
        self, new: list[dict[str, Any]], reply: dict[str, Any], meta: dict[str, Any] | None = None
    ) -> None:
        if self.count == 0 and not self.messages:
            # the first turn's leading system messages stay when older turns are dropped
            lead = 0
            while lead < len(new) and new[lead].get("role") in _PINNED_ROLES:
                lead += 1
            self.pinned, new = [*self.pinned, *new[:lead]], new[lead:]
        self.messages.extend(new)
        self.messages.append(reply)
        self.turns.append(len(self.messages))
        self.meta.append(meta or {})
        self.count += 1

    def drop_oldest(self) -> bool:
        """Drop the oldest kept turn; False when none is left to drop."""
        if not self.turns:
            return False
        end = self.turns[0]
        self.messages = self.messages[end:]
        self.turns = [t - end for t in self.turns[1:]]
        self.meta = self.meta[1:]
        return True


def _objects(value: Any) -> bool:
    """A JSON list of objects."""
    return isinstance(value, list) and all(isinstance(v, dict) for v in value)


def _same(a: Any, b: Any) -> bool:
    """Two JSON values alike to the byte (`1` is not `true`); after a decode, a value the turn
    before echoed too is the same object."""
    return a is b or orjson.dumps(a) == orjson.dumps(b)


def _echo_items(echo: dict[str, Any], before: dict[str, Any] | None) -> list[Any]:
    """A turn's echoed fields as stored, in order: `[name, value]`, or `name` alone for one
    the turn before echoed alike."""
    return [
        name if before is not None and name in before and _same(before[name], value)
        else [name, value]
        for name, value in echo.items()
    ]  # fmt: skip


def _with_echoes(meta: list[dict[str, Any]], echoes: Any) -> list[dict[str, Any]]:
    """Stored turns' metadata with their echoed fields back (`History.encode`);
    `Unreadable` for any other shape."""
    if not isinstance(echoes, list) or len(echoes) != len(meta):
        raise Unreadable("not a stored conversation")
    out, before = [], None
    for entry, items in zip(meta, echoes, strict=True):
        if items is None:
            out.append(entry)
            before = None
            continue
        if not isinstance(items, list):
            raise Unreadable("not a stored conversation")
        echo: dict[str, Any] = {}
        for item in items:
            if isinstance(item, str) and before is not None and item in before:
                echo[item] = before[item]
            elif isinstance(item, list) and len(item) == 2 and isinstance(item[0], str):
                echo[item[0]] = item[1]
            else:
                raise Unreadable("not a stored conversation")
        out.append({**entry, "echo": echo})
        before = echo
    return out


def _meta_size(entry: dict[str, Any], before: dict[str, Any] | None) -> int:
    """About the bytes a turn's metadata takes stored after a turn that echoed `before` (None:
    as the first kept turn, or after one that echoed nothing); 0 for a chat turn's `{}`."""
    if not entry:
        return 0
    echo = entry.get("echo")
    if not isinstance(echo, dict):
        return len(orjson.dumps(entry))
    rest = len(orjson.dumps({k: v for k, v in entry.items() if k != "echo"}))
    return rest + len(orjson.dumps(_echo_items(echo, before)))


def _echo_of(entry: dict[str, Any]) -> dict[str, Any] | None:
    echo = entry.get("echo")
    return echo if isinstance(echo, dict) else None


def _fits(turn: Turn, limit: int) -> bool:
    return messages_size(turn.messages) <= limit and meta_size(turn.history) <= limit


def meta_size(history: History) -> int:
    """About the bytes of what `history`'s kept turns keep besides their messages (their
    responses' fields, `History.meta`), as stored."""
    before, total = None, 0
    for entry in history.meta:
        total += _meta_size(entry, before)
        before = _echo_of(entry)
    return total


def _without_removed(message: dict[str, Any]) -> dict[str, Any] | None:
    """A stored message as a prompt carries it: None when it was taken out, a copy without the
    calls taken out when some were."""
    if message.get(REMOVED):
        return None
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return message
    kept = [c for c in calls if not (isinstance(c, dict) and c.get(REMOVED))]
    return message if len(kept) == len(calls) else {**message, "tool_calls": kept}


def messages_size(messages: list[dict[str, Any]]) -> int:
    return len(orjson.dumps(messages))


def _trim(history: History, new: list[dict[str, Any]], limit: int, *, keep: int) -> bool:
    """Drop the oldest turns until pinned + kept turns + `new` fit in `limit` bytes of JSON,
    and so does what the kept turns keep besides (`meta_size`), or only `keep` turns are
    left; each message is measured once. True when any was dropped."""
    sizes = [len(orjson.dumps(m)) for m in history.messages]
    parts = len(history.pinned) + len(sizes) + len(new)
    fixed = sum(len(orjson.dumps(m)) for m in (*history.pinned, *new))
    total = 2 + fixed + sum(sizes) + max(parts - 1, 0)
    meta = history.meta
    # each turn's metadata as stored after the one before it; a turn's echoed fields count
    # whole once it is the first kept
    after = [_meta_size(m, _echo_of(meta[k - 1]) if k else None) for k, m in enumerate(meta)]
    kept_meta = sum(after)
    start = dropped = 0
    while (total > limit or kept_meta > limit) and len(history.turns) - dropped > keep:
        end = history.turns[dropped]
        total -= sum(sizes[start:end]) + (end - start)
        kept_meta -= after[dropped]
        if dropped + 1 < len(meta):
            whole = _meta_size(meta[dropped + 1], None)
            kept_meta += whole - after[dropped + 1]
            after[dropped + 1] = whole
        start, dropped = end, dropped + 1
    for _ in range(dropped):
        history.drop_oldest()
    return dropped > 0


class ConversationStore(Protocol):
    """Where histories live: `load` refreshes the TTL; a lease is a token under its own key.

    A lease whose take or commit did not answer (StateUnavailable) may hold its conversation
    all the same; the store releases it once it answers again. `release` never raises for a
    store that does not answer: it releases later."""

    async def load(self, tenant: str, cid: str) -> bytes | None: ...
    async def create(self, tenant: str, cid: str, token: bytes) -> None: ...
    async def lease(self, tenant: str, cid: str, token: bytes) -> bool: ...
    async def commit(self, tenant: str, cid: str, token: bytes, blob: bytes) -> bool: ...
    async def release(self, tenant: str, cid: str, token: bytes) -> None: ...
    async def extend(self, tenant: str, cid: str, token: bytes) -> bool: ...
    async def delete(self, tenant: str, cid: str) -> bool: ...


class MemoryConversations:
    """One process's conversations: a TTL cache per tenant and leases with deadlines. Past
    `memory_max_conversations`, or `memory_max_bytes`, in all, the tenant that holds the most
    (conversations, or bytes) loses its least recently used: a tenant that opens conversations
    without end, or fills them, evicts its own, not another's."""

    def __init__(self, config: ConversationConfig, *, clock: Any = time.monotonic) -> None:
        self._ttl = config.ttl
        self._lease_s = config.lease
        self._clock = clock
        self._max = config.memory_max_conversations
        self._max_bytes = config.memory_max_bytes
        self._tenant_max = config.tenant_max_conversations
        self._tenant_max_bytes = config.tenant_max_bytes
        self._data: dict[str, TTLCache[str, bytes]] = {}
        """By tenant; each cache's `currsize` is its histories' bytes."""
        self._leases: dict[tuple[str, str], tuple[bytes, float]] = {}

    def _put(self, tenant: str, cid: str, blob: bytes) -> None:
        held = self._data.get(tenant)
        if held is None:
            held = self._data[tenant] = TTLCache(
                maxsize=self._max_bytes, ttl=self._ttl, timer=self._clock, getsizeof=len
            )
        held[cid] = blob  # setting again restarts its TTL and makes it the most recently used
        # the tenant's own bound: its least recently used go (never the one just written)
        while len(held) > 1 and (
            len(held) > self._tenant_max or held.currsize > self._tenant_max_bytes
        ):
            held.popitem()
        self._fit()

    def _fit(self) -> None:
        """Evict down to `memory_max_conversations` and `memory_max_bytes`: each time the least
        recently used of the tenant holding the most (the tenants are the configured ones:
        few)."""
        for tenant, held in list(self._data.items()):
            held.expire()
            if not held:
                del self._data[tenant]
        count = sum(len(held) for held in self._data.values())
        while count > self._max:
            max(self._data.values(), key=len).popitem()
            count -= 1
        size = sum(held.currsize for held in self._data.values())
        while size > self._max_bytes:
            held = max(self._data.values(), key=lambda h: h.currsize)
            size -= len(held.popitem()[1])

    async def load(self, tenant: str, cid: str) -> bytes | None:
        held = self._data.get(tenant)
        blob = held.get(cid) if held is not None else None
        if blob is not None:
            self._put(tenant, cid, blob)  # refreshed on use
        return blob

    async def create(self, tenant: str, cid: str, token: bytes) -> None:
        self._leases[(tenant, cid)] = (token, self._clock() + self._lease_s)

    async def lease(self, tenant: str, cid: str, token: bytes) -> bool:
        key = (tenant, cid)
        held = self._leases.get(key)
        if held is not None and held[1] > self._clock():
            return False
        self._leases[key] = (token, self._clock() + self._lease_s)
        return True

    def _holds(self, key: tuple[str, str], token: bytes) -> bool:
        held = self._leases.get(key)
        return held is not None and held[0] == token and held[1] > self._clock()

    async def commit(self, tenant: str, cid: str, token: bytes, blob: bytes) -> bool:
        key = (tenant, cid)
        if not self._holds(key, token):
            return False
        self._put(tenant, cid, blob)
        del self._leases[key]
        return True

    async def release(self, tenant: str, cid: str, token: bytes) -> None:
        key = (tenant, cid)
        held = self._leases.get(key)
        if held is not None and held[0] == token:
            del self._leases[key]

    async def extend(self, tenant: str, cid: str, token: bytes) -> bool:
        key = (tenant, cid)
        if not self._holds(key, token):
            return False
        self._leases[key] = (token, self._clock() + self._lease_s)
        return True

    async def delete(self, tenant: str, cid: str) -> bool:
        self._leases.pop((tenant, cid), None)  # a turn in progress then fails to commit
        held = self._data.get(tenant)
        return held is not None and held.pop(cid, None) is not None


class RedisConversations:
    """Conversations in Redis: `{prefix}conv:{tenant}:{id}` and its lease `…conv-lease:…`."""

    def __init__(self, redis: RedisState, config: ConversationConfig) -> None:
        self._redis = redis
        self._config = config
        self._ttl_ms = int(config.ttl * 1000)
        self._lease_ms = int(config.lease * 1000)

    def _key(self, tenant: str, cid: str) -> str:
        return f"{self._redis.prefix}conv:{tenant}:{cid}"

    def _lease_key(self, tenant: str, cid: str) -> str:
        return f"{self._redis.prefix}conv-lease:{tenant}:{cid}"

    def _share(self, tenant: str) -> Share:
        """The tenant's conversations, by last use, within its bound."""
        prefix, config = self._redis.prefix, self._config
        return Share(f"{prefix}conv-index:{tenant}", f"{prefix}conv-sizes:{tenant}",
                     f"{prefix}conv:{tenant}:", config.ttl, config.tenant_max_conversations,
                     config.tenant_max_bytes)  # fmt: skip

    async def load(self, tenant: str, cid: str) -> bytes | None:
        return await self._redis.get_shared(
            self._key(tenant, cid), self._ttl_ms, self._share(tenant), cid
        )

    async def create(self, tenant: str, cid: str, token: bytes) -> None:
        lease = self._lease_key(tenant, cid)
        try:
            await self._redis.set(lease, token, self._lease_ms)
        except StateUnavailable:
            self._redis.release_soon(lease, token, self._lease_ms)
            raise

    async def lease(self, tenant: str, cid: str, token: bytes) -> bool:
        return await self._redis.take_lease(self._lease_key(tenant, cid), token, self._lease_ms)

    async def commit(self, tenant: str, cid: str, token: bytes, blob: bytes) -> bool:
        lease = self._lease_key(tenant, cid)
        try:
            return await self._redis.commit(lease, token, self._key(tenant, cid), blob,
                                            self._ttl_ms, self._share(tenant), cid)  # fmt: skip
        except StateUnavailable:  # written or not, the lease must not outlive the turn
            self._redis.release_soon(lease, token, self._lease_ms)
            raise

    async def release(self, tenant: str, cid: str, token: bytes) -> None:
        lease = self._lease_key(tenant, cid)
        try:
            await self._redis.release(lease, token)
        except StateUnavailable:
            self._redis.release_soon(lease, token, self._lease_ms)

    async def extend(self, tenant: str, cid: str, token: bytes) -> bool:
        return await self._redis.extend(self._lease_key(tenant, cid), token, self._lease_ms)

    async def delete(self, tenant: str, cid: str) -> bool:
        # The lease goes first: a turn in progress then fails its compare-and-set commit, and
        # cannot write the conversation back between the two deletes.
        await self._redis.delete(self._lease_key(tenant, cid))
        return await self._redis.delete_shared(self._share(tenant), cid) > 0


@dataclass(slots=True)
class Turn:
    """One turn in progress: the prompt to send, and what to commit once the reply completed."""

    tenant: str
    cid: str
    number: int
    """This turn's number in its conversation (from 1)."""
    history: History
    new: list[dict[str, Any]]
    token: bytes | None
    """The lease held, or None when the turn is not stored (Responses `store: false`)."""
    truncated: bool = False
    truncate: bool = True
    """Past `max_bytes`, drop the oldest turns (True) or refuse the turn with a 413: the
    configured `overflow`, or what the request asked (Responses `truncation`)."""

    @property
    def messages(self) -> list[dict[str, Any]]:
        return self.history.prompt(self.new)


class Conversations:
    """Opens, commits and releases turns on a `ConversationStore`, within the size limit."""

    def __init__(self, store: ConversationStore, config: ConversationConfig) -> None:
        self.store = store
        self.config = config

    def _truncates(self, asked: bool | None) -> bool:
        return self.config.overflow == "truncate" if asked is None else asked

    async def start(
        self,
        tenant: str,
        new: list[dict[str, Any]],
        *,
        store: bool = True,
        truncate: bool | None = None,
    ) -> Turn:
        """Turn 1 of a new conversation (`truncate`: see `Turn.truncate`; None: as configured)."""
        cid = new_conversation_id()
        token = os.urandom(12) if store else None
        turn = Turn(tenant, cid, 1, History(created_at=int(time.time())), new, token)
        turn.truncate = self._truncates(truncate)
        self._fit(turn)
        if token is not None:
            await self.store.create(tenant, cid, token)
        return turn

    async def open(
        self, tenant: str, items: list[dict[str, Any]], metadata: dict[str, Any]
    ) -> tuple[str, History]:
        """A new conversation holding `items` and no turn yet (`POST /v1/conversations`): they
        lead every prompt and are never dropped to fit (as the first turn's system messages).
        Its id and what was stored."""
        cid, token = new_conversation_id(), os.urandom(12)
        history = History(pinned=list(items), created_at=int(time.time()), metadata=metadata)
        if messages_size(history.prompt([])) > self.config.max_bytes:
            raise PayloadTooLarge(
                f"the conversation would exceed {self.config.max_bytes} bytes of messages",
                code="conversation_too_large",
            )
        await self.store.create(tenant, cid, token)
        await self.store.commit(tenant, cid, token, history.encode())
        return cid, history

    async def resume(
        self,
        tenant: str,
        cid: str,
        new: list[dict[str, Any]],
        *,
        after: int | None = None,
        store: bool = True,
        truncate: bool | None = None,
        missing: ConversationNotFound,
    ) -> Turn:
        """The next turn after turn `after` (None: the latest). Continuing an earlier turn forks a
        new conversation from it (the Responses API lets any stored response be continued)."""
        token = os.urandom(12) if store else None
        if token is not None and not await self.store.lease(tenant, cid, token):
            raise ConversationBusy(BUSY)
        try:
            history = self._decode(await self.store.load(tenant, cid), tenant, cid)
            if history is None:
                raise missing
            base = history if after is None else history.upto(after)
            if base is None:
                raise missing
            if base is not history:  # a fork: the original stays as it is
                base.created_at = int(time.time())
                if token is not None:
                    await self.store.release(tenant, cid, token)
                    cid = new_conversation_id()
                    await self.store.create(tenant, cid, token)
            new, base.pending = [*base.pending, *new], []  # items added since lead this turn
            turn = Turn(tenant, cid, base.count + 1, base, new, token)
            turn.truncate = self._truncates(truncate)
            self._fit(turn)
        except BaseException:
            if token is not None:
                await self.store.release(tenant, cid, token)
            raise
        return turn

    def _fit(self, turn: Turn) -> None:
        """Apply the size limit to the prompt this turn sends, and to what the turns before it
        keep besides (`meta_size`): drop the oldest turns, or 413."""
        limit = self.config.max_bytes
        stored = turn.history.stored
        if stored and stored + messages_size(turn.new) <= limit:
            return  # the stored value holds both: each is within the limit
        if _fits(turn, limit):
            return
        if turn.truncate:
            history = turn.history.copy()
            turn.truncated = _trim(history, turn.new, limit, keep=0)
            turn.history = history
            if _fits(turn, limit):
                return
        what = "messages" if messages_size(turn.messages) > limit else (
            "kept responses (their echoed instructions, tools and other fields)")  # fmt: skip
        raise PayloadTooLarge(
            f"the conversation would exceed {limit} bytes of {what}"
            + ("" if turn.truncate else "; start a new one"),
            code="conversation_too_large",
        )

    async def commit(
        self, turn: Turn, reply: dict[str, Any], meta: dict[str, Any] | None = None
    ) -> bool:
        """Append the turn, its reply and `meta` (see `History.meta`); False when the lease
        was lost (nothing written)."""
        if turn.token is None:
            return True
        history = turn.history
        history.append(list(turn.new), reply, meta)
        if turn.truncate:
            _trim(history, [], self.config.max_bytes, keep=1)
        return await self.store.commit(turn.tenant, turn.cid, turn.token, history.encode())

    async def release(self, turn: Turn) -> None:
        if turn.token is not None:
            await self.store.release(turn.tenant, turn.cid, turn.token)

    async def release_lease(self, tenant: str, cid: str, token: bytes) -> None:
        """Release the lease `token` holds, whichever request holds it (a deleted background
        response's turn, `StoredObjects.delete`): its commit then writes nothing."""
        await self.store.release(tenant, cid, token)

    async def extend(self, turn: Turn) -> bool:
        """Renew the turn's lease for another `lease` seconds (a background answer, which may
        run longer); False when it no longer holds it (its conversation was deleted)."""
        if turn.token is None:
            return True
        return await self.store.extend(turn.tenant, turn.cid, turn.token)

    async def update(
        self,
        tenant: str,
        cid: str,
        change: Callable[[History], None],
        *,
        missing: ConversationNotFound,
    ) -> History:
        """Apply `change` to a stored conversation between turns, under its lease (409 while a
        turn is in progress); what was stored."""
        token = os.urandom(12)
        if not await self.store.lease(tenant, cid, token):
            raise ConversationBusy(BUSY)
        try:
            history = self._decode(await self.store.load(tenant, cid), tenant, cid)
            if history is None:
                raise missing
            change(history)
            if messages_size(history.prompt(history.pending)) > self.config.max_bytes:
                raise PayloadTooLarge(
                    f"the conversation would exceed {self.config.max_bytes} bytes of messages",
                    code="conversation_too_large",
                )
        except BaseException:
            await self.store.release(tenant, cid, token)
            raise
        if not await self.store.commit(tenant, cid, token, history.encode()):
            raise ConversationBusy("the conversation changed meanwhile; retry")
        return history

    async def history(self, tenant: str, cid: str) -> History | None:
        """A stored conversation as it is now (None: unknown, expired or unreadable); read
        only."""
        return self._decode(await self.store.load(tenant, cid), tenant, cid)

    @staticmethod
    def _decode(blob: bytes | None, tenant: str, cid: str) -> History | None:
        """The stored history; None when there is none, or none this edge can read (logged:
        answered as not found, as OpenAI's shape has no better word for it)."""
        if blob is None:
            return None
        try:
            return History.decode(blob)
        except Unreadable as err:
            warn_unreadable(f"conversation {conversation_name(cid)} of tenant {tenant!r}", err)
            return None

    async def delete(self, tenant: str, cid: str) -> bool:
        """Forget a conversation, every turn of it; False when there was none."""
        return await self.store.delete(tenant, cid)


__all__ = [
    "CONVERSATION_HEADER",
    "REMOVED",
    "ConversationStore",
    "Conversations",
    "History",
    "MemoryConversations",
    "RedisConversations",
    "Turn",
    "conversation_name",
    "parse_conversation_name",
    "parse_response_id",
    "response_id",
]
