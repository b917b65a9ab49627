"""Background responses (`background: true` on `/v1/responses`): the client gets the response
object at once, `queued`, and polls `GET /v1/responses/{id}` while the edge generates the answer
on its own; `POST /v1/responses/{id}/cancel` stops it (docs/state.md, "Background responses").

A background turn is an ordinary stored turn run without its client. Streamed, its events
also go to an event log (`Broadcast`), which a client that left reads back from any edge with
`GET /v1/responses/{id}?stream=true&starting_after=N` (`follow`). While it runs, and after
it failed or was cancelled, a record under its response id says so; once its answer is stored
with its conversation, the record goes, and the stored turn is what `GET` shows. Records live
where conversations do (the memory store or Redis), so any worker answers a poll or a cancel:
the worker running the turn reads its record every `POLL_S` and stops when it says `cancelled`.
A running record has a heartbeat beside it that the worker renews (`BEAT_S`): a reader that
finds it gone knows no edge generates the answer any longer, and reports it failed.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson
from cachetools import TTLCache

from edge.errors import StateUnavailable
from edge.state.config import ConversationConfig
from edge.state.redis_store import RedisState, Share, Unreadable, read_or_none

POLL_S = 0.5
"""How often a running background turn reads its record for a cancel."""
BEAT_S = 30.0
"""How long a running record's heartbeat lasts: past it with no renewal, no edge is generating
the answer (its edge stopped, or lost Redis), and readers report it `failed` (`ABANDONED`)."""
BEAT_EVERY_S = 5.0
"""How often the edge generating a background answer renews its heartbeat (at a poll)."""
RUNNING = "in_progress"
CANCELLED = "cancelled"
FAILED = "failed"
DELETED = "deleted"
"""A record's status once `DELETE /v1/responses/{id}` took it: readers find nothing (a 404),
the edge still generating it stops at its next poll, and its final record is not written over
it (`RecordStore.settle`), so a deleted response never reads back."""
ABANDONED = {
    "code": "abandoned",
    "message": "the edge generating this response stopped renewing it (it stopped, or lost the "
    "state store); it will not complete",
}
"""The error a reader gives a running record whose heartbeat ran out."""


@dataclass(slots=True)
class Record:
    """What `GET /v1/responses/{id}` shows of a background response not stored (yet)."""

    status: str
    """`in_progress`, `cancelled`, `failed` or `deleted` (`DELETED`)."""
    meta: dict[str, Any]
    """The response's own fields, as `ResponseBuilder.stored()` gives them."""
    error: dict[str, Any] | None = None
    """A failed one's `{"code", "message"}`."""
    sent: list[list[Any]] = field(default_factory=list)
    """What its turn sends, as `[place, message]` (`History.next_input`), for its input items."""
    beat: bool = False
    """Its edge keeps a heartbeat beside it while it runs (`BEAT_S`); False for a record
    written before heartbeats were kept, which is trusted as it is."""
    alive: bool = True
    """Read back: False when it has a heartbeat and the heartbeat ran out (not stored)."""
    lease: str | None = None
    """The lease token (hex) its turn holds while it runs: a delete releases that lease, so
    an answer that completes meanwhile cannot store its turn (its commit needs the lease)."""

    def encode(self) -> bytes:
        obj: dict[str, Any] = {"s": self.status, "m": self.meta, "e": self.error, "i": self.sent}
        if self.beat:
            obj["h"] = 1
        if self.lease is not None:
            obj["k"] = self.lease
        return orjson.dumps(obj)

    @classmethod
    def decode(cls, blob: bytes) -> Record:
        """A stored record; `Unreadable` for a value of any other shape."""
        try:
            obj = orjson.loads(blob)
        except orjson.JSONDecodeError as exc:
            raise Unreadable(f"not JSON: {exc}") from None
        if not (
            isinstance(obj, dict) and isinstance(obj.get("s"), str)
            and isinstance(obj.get("m"), dict) and isinstance(obj.get("e") or {}, dict)
            and isinstance(obj.get("i") or [], list)
            and isinstance(obj.get("k") or "", str)
        ):  # fmt: skip
            raise Unreadable("not a background response's record")
        return cls(obj["s"], obj["m"], obj.get("e"), list(obj.get("i") or []),
                   bool(obj.get("h")), lease=obj.get("k") or None)  # fmt: skip

    @classmethod
    def read(cls, blob: bytes | None, what: str) -> Record | None:
        """`decode`, with None for no value or one this edge cannot read (logged)."""
        return read_or_none(cls.decode, blob, what)

    def as_read(self) -> Record:
        """What a reader is told: a running record whose heartbeat ran out is `failed`."""
        if self.status == RUNNING and not self.alive:
            return Record(FAILED, self.meta, dict(ABANDONED), self.sent)
        return self


TOMBSTONE = Record(DELETED, {}).encode()
"""The record a deleted background response leaves (`DELETED`), byte for byte: what `settle`
compares with, in memory as in Redis."""
CANCELLED_PREFIX = Record(CANCELLED, {}).encode()[: len(b'{"s":"cancelled"')]
_RUNNING_PREFIX = Record(RUNNING, {}).encode()[: len(b'{"s":"in_progress"')]
"""How every cancelled record's encoding begins: what `settle(..., keep_cancelled=True)`
compares with."""


def kept_for(config: ConversationConfig) -> float:
    """How long records and event logs live: a conversation's TTL past the longest run, so
    neither expires under an answer still running."""
    return config.ttl + config.background_max


class RecordStore(Protocol):
    """Background responses' records by tenant and response id (`kept_for`). A running one
    written with `start` has a heartbeat that its edge renews with `beat`; `get` says whether
    it is still alive (`Record.alive`)."""

    async def put(self, tenant: str, rid: str, record: Record) -> None: ...
    async def get(self, tenant: str, rid: str) -> Record | None: ...
    async def delete(self, tenant: str, rid: str) -> None: ...
    async def start(self, tenant: str, rid: str, record: Record) -> None: ...

    async def settle(
        self, tenant: str, rid: str, record: Record, *, keep_cancelled: bool = False
    ) -> bool:
        """`put`, unless the record there is a deletion's `TOMBSTONE` (then nothing is
        written: a deleted response stays deleted), or, with `keep_cancelled`, a cancelled
        one (a cancel answered `cancelled` stays so); whether it was written. One atomic
        step."""
        ...

    async def beat(self, tenant: str, rid: str) -> Record | None:
        """Renew the heartbeat for `BEAT_S` and read the record, in one round trip."""
        ...


class MemoryRecords:
    """Records in this process (the memory store: one process sees its own only), per tenant:
    past `memory_max_conversations` in all, the tenant holding the most loses its oldest ended
    record (a running one only when it has no other), so a tenant whose responses fail or are
    cancelled without end evicts its own, never another tenant's."""

    def __init__(self, config: ConversationConfig) -> None:
        self._max = config.memory_max_conversations
        self._ttl = kept_for(config)
        self._tenants: dict[str, TTLCache[str, bytes]] = {}

    def _fit(self) -> None:
        for tenant, held in list(self._tenants.items()):
            held.expire()
            if not held:
                del self._tenants[tenant]
        count = sum(len(held) for held in self._tenants.values())
        while count > self._max:
            held = max(self._tenants.values(), key=len)
            ended = (rid for rid, blob in held.items() if not blob.startswith(_RUNNING_PREFIX))
            del held[next(ended, None) or next(iter(held))]
            count -= 1

    def _set(self, tenant: str, rid: str, blob: bytes) -> None:
        held = self._tenants.get(tenant)
        if held is None:
            held = self._tenants[tenant] = TTLCache(maxsize=self._max, ttl=self._ttl)
        held[rid] = blob
        self._fit()

    def _get(self, tenant: str, rid: str) -> bytes | None:
        held = self._tenants.get(tenant)
        return None if held is None else held.get(rid)

    async def put(self, tenant: str, rid: str, record: Record) -> None:
        self._set(tenant, rid, record.encode())

    async def get(self, tenant: str, rid: str) -> Record | None:
        return Record.read(self._get(tenant, rid), f"record {rid}")

    async def delete(self, tenant: str, rid: str) -> None:
        held = self._tenants.get(tenant)
        if held is not None:
            held.pop(rid, None)

    async def start(self, tenant: str, rid: str, record: Record) -> None:
        # one process's records die with it: no heartbeat needed
        await self.put(tenant, rid, record)

    async def settle(
        self, tenant: str, rid: str, record: Record, *, keep_cancelled: bool = False
    ) -> bool:
        # nothing awaits between the read and the write: atomic within the process
        held = self._get(tenant, rid)
        if held == TOMBSTONE or (
            keep_cancelled and held is not None and held.startswith(CANCELLED_PREFIX)
        ):
            return False
        self._set(tenant, rid, record.encode())
        return True

    async def beat(self, tenant: str, rid: str) -> Record | None:
        return await self.get(tenant, rid)


class RedisRecords:
    """Records in Redis: `{prefix}bg:{tenant}:{response id}`, for `kept_for`; a running one's
    heartbeat beside it, `{prefix}bg-alive:…`, for `BEAT_S`."""

    def __init__(self, redis: RedisState, config: ConversationConfig) -> None:
        self._redis = redis
        self._config = config
        self._ttl_ms = int(kept_for(config) * 1000)
        self._beat_ms = int(BEAT_S * 1000)

    def _key(self, tenant: str, rid: str) -> str:
        return f"{self._redis.prefix}bg:{tenant}:{rid}"

    def _share(self, tenant: str) -> Share:
        """The tenant's records, within its bound (`tenant_max_conversations`,
        `tenant_max_bytes`): past it, its oldest go."""
        prefix, config = self._redis.prefix, self._config
        return Share(f"{prefix}bg-index:{tenant}", f"{prefix}bg-sizes:{tenant}",
                     f"{prefix}bg:{tenant}:", kept_for(config), config.tenant_max_conversations,
                     config.tenant_max_bytes)  # fmt: skip

    def _alive_key(self, tenant: str, rid: str) -> str:
        return f"{self._redis.prefix}bg-alive:{tenant}:{rid}"

    async def put(self, tenant: str, rid: str, record: Record) -> None:
        await self._redis.set_shared(self._key(tenant, rid), record.encode(), self._ttl_ms,
                                     self._share(tenant), rid)  # fmt: skip

    async def get(self, tenant: str, rid: str) -> Record | None:
        blob, alive = await self._redis.get_many(
            [self._key(tenant, rid), self._alive_key(tenant, rid)]
        )
        record = Record.read(blob, f"record {rid} of tenant {tenant!r}")
        if record is not None and record.beat:
            record.alive = alive is not None
        return record

    async def delete(self, tenant: str, rid: str) -> None:
        await self._redis.delete_shared(self._share(tenant), rid)

    async def start(self, tenant: str, rid: str, record: Record) -> None:
        record.beat = True
        await self._redis.set(self._alive_key(tenant, rid), b"1", self._beat_ms)
        await self.put(tenant, rid, record)

    async def settle(
        self, tenant: str, rid: str, record: Record, *, keep_cancelled: bool = False
    ) -> bool:
        return await self._redis.set_unless(
            self._key(tenant, rid), record.encode(), self._ttl_ms, TOMBSTONE,
            CANCELLED_PREFIX if keep_cancelled else b"", self._share(tenant), rid,
        )  # fmt: skip

    async def beat(self, tenant: str, rid: str) -> Record | None:
        blob = await self._redis.get_and_set(
            self._key(tenant, rid), self._alive_key(tenant, rid), b"1", self._beat_ms
        )
        return Record.read(blob, f"record {rid} of tenant {tenant!r}")


END = b""
"""The last entry of a finished event log (events are never empty)."""
FOLLOW_POLL_S = 0.05
"""How often a stream resumed from Redis looks for new events (from memory, it is woken)."""
FOLLOW_RETRY_S = 0.25
"""The wait before a resumed stream reads again after a read the store did not answer."""
FOLLOW_PATIENCE_S = 10.0
"""How long a resumed stream tries reads the store does not answer, in a row, before it ends
with an `error` event."""
FLUSH_RETRIES_S = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0)
"""The waits before each new try of a finished stream's entries the store did not take."""
FOLLOW_STATUS_S = 1.0
"""How often a resumed stream with no new events reads whether its response ended."""
_FLUSHING: set[asyncio.Task[None]] = set()
"""Finished streams' entries waiting for the store (`Broadcast.close`), held until done."""


class EventLog(Protocol):
    """A background stream's events in order (entry N: `sequence_number` N), read by a client
    that resumes it (`GET /v1/responses/{id}?stream=true&starting_after=N`) from any edge that
    shares the store. Ends with `END`."""

    async def append(
        self, tenant: str, rid: str, events: list[bytes], at: int, writer: str = ""
    ) -> None:
        """Add `events` as entries `at` on; those an earlier try already added (its answer
        came too late) are not added twice. At 0 the log starts anew, `writer`'s: a log
        already there is a deleted response's, whose id the next turn of its conversation
        took; past 0, another writer's events (that deleted response's, still running until
        its edge sees the delete) are not added."""
        ...

    async def read(self, tenant: str, rid: str, start: int) -> list[bytes] | None:
        """Entries from `start` on (`END` last once finished); None: no log kept."""
        ...

    async def wait(self, tenant: str, rid: str, timeout: float) -> None:
        """Until an entry may have been added (at most `timeout` s)."""
        ...

    async def clear(self, tenant: str, rid: str) -> None:
        """Drop the log (its response was deleted): its writer, if it still runs, adds
        nothing after."""
        ...


@dataclass(slots=True)
class _Log:
    entries: list[bytes] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    size: int = 0
    """Bytes of its entries."""
    writer: str = ""
    """Whose entries it holds (`EventLog.append`)."""


def _log_size(log: _Log) -> int:
    return log.size


class MemoryEvents:
    """Event logs in this process, each for `kept_for` after its last event, as in Redis; a
    reader waits to be woken by the next append. At most `memory_max_conversations` logs and
    `memory_max_bytes` of entries: past either, the log written longest ago goes (a stream
    that outgrew the whole budget alone is dropped, and reads as not kept)."""

    def __init__(self, config: ConversationConfig) -> None:
        self._max = config.memory_max_conversations
        self._logs: TTLCache[tuple[str, str], _Log] = TTLCache(
            maxsize=config.memory_max_bytes, ttl=kept_for(config), getsizeof=_log_size
        )

    async def append(
        self, tenant: str, rid: str, events: list[bytes], at: int, writer: str = ""
    ) -> None:
        key = (tenant, rid)
        log = self._logs.get(key)
        if at == 0:  # another response's log (`EventLog.append`) goes
            if log is not None:
                log.changed.set()  # its readers read again, and find the new one
            log = _Log(writer=writer)
        elif log is None:  # cleared (or gone): nothing to add to, as in Redis
            return
        elif log.writer != writer:  # another stream's
            return
        if len(log.entries) >= at:  # never fails, so never behind; as Redis does otherwise
            added = events[len(log.entries) - at :]
            log.entries.extend(added)
            log.size += sum(map(len, added))
        try:
            self._logs[key] = log  # its size counted again; the newest now
        except ValueError:  # larger than the whole budget on its own
            self._logs.pop(key, None)
        while len(self._logs) > self._max:
            self._logs.popitem()
        log.changed.set()
        log.changed = asyncio.Event()

    async def read(self, tenant: str, rid: str, start: int) -> list[bytes] | None:
        log = self._logs.get((tenant, rid))
        return None if log is None else log.entries[start:]

    async def clear(self, tenant: str, rid: str) -> None:
        log = self._logs.pop((tenant, rid), None)
        if log is not None:
            log.changed.set()

    async def wait(self, tenant: str, rid: str, timeout: float) -> None:
        log = self._logs.get((tenant, rid))
        if log is not None:
            try:
                async with asyncio.timeout(timeout):
                    await log.changed.wait()
            except TimeoutError:
                return


class RedisEvents:
    """Event logs in Redis: a list `{prefix}bg-events:{tenant}:{response id}`, for `kept_for`
    after its last event; a reader on another edge polls it every `FOLLOW_POLL_S`."""

    def __init__(self, redis: RedisState, config: ConversationConfig) -> None:
        self._redis = redis
        self._ttl_ms = int(kept_for(config) * 1000)

    def _key(self, tenant: str, rid: str) -> str:
        return f"{self._redis.prefix}bg-events:{tenant}:{rid}"

    def _writer_key(self, tenant: str, rid: str) -> str:
        return f"{self._redis.prefix}bg-events-writer:{tenant}:{rid}"

    async def append(
        self, tenant: str, rid: str, events: list[bytes], at: int, writer: str = ""
    ) -> None:
        await self._redis.list_append_at(self._key(tenant, rid), at, events, self._ttl_ms,
                                         (self._writer_key(tenant, rid), writer))  # fmt: skip

    async def read(self, tenant: str, rid: str, start: int) -> list[bytes] | None:
        return await self._redis.list_from(self._key(tenant, rid), start)

    async def wait(self, tenant: str, rid: str, timeout: float) -> None:
        await asyncio.sleep(min(timeout, FOLLOW_POLL_S))

    async def clear(self, tenant: str, rid: str) -> None:
        await self._redis.delete(self._key(tenant, rid), self._writer_key(tenant, rid))


class Broadcast:
    """One background stream's events, as the relay hands them over: to its log for any
    client that resumes it, and to the client that asked, while that one stays. Past `cap`
    bytes the log stops (and ends) where it is; the asking client gets all, unless it lets
    `cap` bytes wait unread (then its stream ends, and it may resume from the log)."""

    def __init__(self, log: EventLog, tenant: str, rid: str, cap: int) -> None:
        self._log, self._tenant, self._rid, self._cap = log, tenant, rid, cap
        self.local: asyncio.Queue[bytes | None] | None = asyncio.Queue()
        self._size = 0
        self._waiting = 0
        """Bytes queued for the asking client and not yet taken."""
        self._logging = True
        self._written = 0
        """Entries the log holds."""
        self._pending: list[bytes] = []
        """Entries not yet in the log (the store did not answer): sent again with the next."""
        self._flushing: asyncio.Task[None] | None = None
        self._writer = os.urandom(8).hex()
        """This stream's token in its log: another stream of the same id (a deleted
        response's, or the next turn's) writes nothing into it."""

    async def send(self, message: Any) -> None:
        """The relay's `send` (an ASGI one): the head is the asking client's to send."""
        if message["type"] != "http.response.body":
            return
        body = message.get("body", b"")
        if body:
            await self.events(body)
        if not message.get("more_body", False):
            await self.close()

    async def events(self, body: bytes) -> None:
        if self.local is not None:
            if self._waiting + len(body) > self._cap:  # a client too slow to read: its
                self.local.put_nowait(None)  # stream ends here, and it resumes from the log
                self.local = None
            else:
                self._waiting += len(body)
                self.local.put_nowait(body)
        self._size += len(body)
        entries = [e + b"\n\n" for e in body.split(b"\n\n") if e]
        if self._size > self._cap:
            entries = [END]  # what came before stays readable; nothing after is kept
        await self._write(entries)

    async def close(self) -> None:
        """The stream ended (once): the log is finished, the asking client's stream too."""
        if self.local is not None:
            self.local.put_nowait(None)
            self.local = None
        await self._write([END])
        if self._pending and self._flushing is None:  # resumed streams wait for the END
            self._flushing = asyncio.get_running_loop().create_task(self._flush_later())
            _FLUSHING.add(self._flushing)
            self._flushing.add_done_callback(_FLUSHING.discard)

    def leave(self) -> None:
        """The asking client went away: its events are no longer queued."""
        self.local = None

    async def _write(self, entries: list[bytes]) -> None:
        if not self._logging or not entries:
            return
        self._logging = entries[-1] != END
        self._pending += entries  # at most `cap` bytes: past it, END is all that is added
        await self._flush()

    async def _flush(self) -> bool:
        """Send the entries not yet in the log; whether they are all there now. A store that
        does not answer keeps them for the next try: the stream goes on meanwhile, and a
        resumed one gets them once the store answers."""
        pending = list(self._pending)
        try:
            await self._log.append(self._tenant, self._rid, pending, self._written, self._writer)
        except StateUnavailable:
            return False
        self._written += len(pending)
        self._pending = self._pending[len(pending) :]
        return not self._pending

    async def _flush_later(self) -> None:
        """The stream ended with entries (its END) not yet in the log: tried again for about
        2 minutes, or a resumed stream would wait for them until `within`."""
        for wait in FLUSH_RETRIES_S:
            await asyncio.sleep(wait)
            if await self._flush():
                return

    async def mine(self) -> AsyncIterator[bytes]:
        """The asking client's events, as they come, until the stream's end."""
        queue = self.local
        if queue is None:
            return
        while (chunk := await queue.get()) is not None:
            self._waiting -= len(chunk)
            yield chunk


async def _read_or_none(log: EventLog, tenant: str, rid: str) -> list[bytes] | None:
    """The whole log, or None where the store does not answer."""
    try:
        return await log.read(tenant, rid, 0)
    except StateUnavailable:
        return None


def error_event(sequence: int, code: str, message: str) -> bytes:
    """A Responses stream's `error` event."""
    data = {"type": "error", "code": code, "message": message, "param": None,
            "sequence_number": sequence}  # fmt: skip
    return b"event: error\ndata: " + orjson.dumps(data) + b"\n\n"


async def follow(
    log: EventLog,
    tenant: str,
    rid: str,
    start: int,
    *,
    within: float,
    patience: float = FOLLOW_PATIENCE_S,
    ended: Callable[[], Awaitable[bool]] | None = None,
) -> AsyncIterator[bytes]:
    """The entries of a background stream from `start` as they come, until `END` or for
    `within` seconds at most (then it stops: a log that is never finished is not waited on).
    A read the store does not answer is tried again, for `patience` seconds in a row at most;
    then the stream ends with an `error` event whose `sequence_number` is the last one sent,
    so a client that resumes after it misses nothing. While no new entry comes, `ended` (the
    response is no longer running) is asked every `FOLLOW_STATUS_S`: a log still without its
    `END` once its last entries' retries (`FLUSH_RETRIES_S`) are over never gets it (the store
    did not take them), and the stream ends with an `error` event, `events_lost`; one resumed
    at or past the `END` of a finished log ends there."""
    deadline = time.monotonic() + within
    failing_since: float | None = None
    asked_at = -FOLLOW_STATUS_S  # the first time no new entry comes, asked at once
    ended_at: float | None = None
    while True:
        try:
            entries = await log.read(tenant, rid, start)
        except StateUnavailable as err:
            now = time.monotonic()
            failing_since = now if failing_since is None else failing_since
            if now - failing_since >= patience or now >= deadline:
                yield error_event(start - 1, err.code or "state_unavailable", (
                    f"{err.message}; resume with starting_after={start - 1}"))  # fmt: skip
                return
            await asyncio.sleep(FOLLOW_RETRY_S)
            continue
        failing_since = None
        if entries is None:
            return
        for entry in entries:
            if entry == END:
                return
            yield entry
        start += len(entries)
        now = time.monotonic()
        left = deadline - now
        if left <= 0:
            return
        if entries:
            ended_at = None
        elif ended is not None and ended_at is None and now - asked_at >= FOLLOW_STATUS_S:
            asked_at = now
            if await ended():
                ended_at = now
                whole = await _read_or_none(log, tenant, rid)
                if whole and whole[-1] == END and start >= len(whole) - 1:
                    return  # resumed at or past its end: nothing more comes
        if ended_at is not None and now - ended_at > sum(FLUSH_RETRIES_S) + FOLLOW_STATUS_S:
            yield error_event(start - 1, "events_lost", (
                "the response ended, but its stream's last events were not kept (the state "
                "store did not take them, or its edge stopped); GET the response (without "
                "stream) for its final state"))  # fmt: skip
            return
        await log.wait(tenant, rid, min(left, 1.0))


__all__ = [
    "ABANDONED",
    "BEAT_EVERY_S",
    "BEAT_S",
    "Broadcast",
    "CANCELLED",
    "CANCELLED_PREFIX",
    "DELETED",
    "END",
    "EventLog",
    "MemoryEvents",
    "RedisEvents",
    "error_event",
    "follow",
    "kept_for",
    "FAILED",
    "POLL_S",
    "RUNNING",
    "MemoryRecords",
    "Record",
    "RecordStore",
    "RedisRecords",
    "TOMBSTONE",
]
