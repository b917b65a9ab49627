"""The state stage: between parsing and routing, it rebuilds a stored conversation's prompt or
finds a cached answer; around the relay, it sees the answer go by to commit or store it.

`StateStage.prepare` runs once the body is parsed. For a request that uses no state (no
conversation, no cache opt-in, not `/v1/responses`) it returns at once and nothing else of this
module runs. Otherwise it sets `ex.state` to a `StateRequest`, whose `begin` answers a cache hit
or wraps the client's `send`, and whose `finish` (always called, in the app's `finally`) commits
the turn or stores the answer only when the response completed, and releases the lease otherwise.
The relay goes through `send` for these requests (not the listener's body writer), so the
wrapper sees every chunk.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import TYPE_CHECKING, Any

import orjson
from prometheus_client import CollectorRegistry, Counter, Gauge

from edge.errors import (
    ConversationNotFound,
    EdgeError,
    InvalidRequest,
    Overloaded,
    StateUnavailable,
)
from edge.sse import SSEScanner, answer_of_body
from edge.stages.validate import CHAT, COMPLETIONS, GENERATE
from edge.state.background import (
    BEAT_EVERY_S,
    CANCELLED,
    DELETED,
    FAILED,
    RUNNING,
    EventLog,
    MemoryEvents,
    MemoryRecords,
    Record,
    RecordStore,
    RedisEvents,
    RedisRecords,
)
from edge.state.cache import (
    CACHE_HEADER,
    CacheTier,
    Entry,
    RedisTier,
    ResponseCache,
    aborted,
    deterministic,
    known_version,
)
from edge.state.cache import weight_version_of as _weight_version
from edge.state.chat_answer import ChatAnswer, message_of_body
from edge.state.completions import (
    CompletionStore,
    MemoryCompletions,
    RedisCompletions,
    StoredCompletions,
    check_store,
)
from edge.state.config import StateConfig
from edge.state.conversations import (
    CONVERSATION_HEADER,
    NEW,
    Conversations,
    ConversationStore,
    MemoryConversations,
    RedisConversations,
    Turn,
    conversation_name,
    parse_conversation_name,
    parse_response_id,
    previous_not_found,
    response_id,
)
from edge.state.redis_store import RedisState
from edge.state.response_builder import ResponseBuilder
from edge.state.responses import MAX_REFUSAL_BYTES, RESPONSES, parse_request, refusal
from edge.state.stored import StoredObjects

if TYPE_CHECKING:
    from edge.exchange import Exchange

log = logging.getLogger(__name__)

Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
CACHEABLE_ROUTES = frozenset({CHAT, COMPLETIONS, GENERATE})
_CONV_HEADER = CONVERSATION_HEADER.encode()
_CACHE_HEADER = CACHE_HEADER.encode()
MAX_CHOICES = 128
"""The most choices of a stored stream kept (SGLang's `n` is far below it)."""
SETTLE_RETRIES_S = (0.25, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0)
"""The waits before each new try of a background response's final record (about 2 min)."""
SETTLE_POLL_S = 0.1
"""How often a final record waiting for Redis looks whether the breaker closed."""
MAX_SETTLING = 1024
"""Final records waiting for Redis at most (past that, left to their heartbeat)."""


def _choice(index: int, answer: ChatAnswer) -> dict[str, Any]:
    """A streamed choice as the `chat.completion` it adds up to has it."""
    message = answer.reply()
    if answer.reasoning:
        message["reasoning_content"] = answer.reasoning
    logprobs = {"content": answer.logprobs} if answer.logprobs else None
    return {"index": index, "message": message, "logprobs": logprobs,
            "finish_reason": answer.finish}  # fmt: skip


class StateStage:
    """Stored conversations and the response cache, for one edge process."""

    def __init__(
        self,
        config: StateConfig,
        *,
        registry: CollectorRegistry,
        on_redis_state: Callable[[str, str, str], None] | None = None,
    ) -> None:
        config.validate()
        self.config = config
        self.redis: RedisState | None = None
        if config.store == "redis":
            assert config.redis_url is not None
            self.redis = RedisState(
                config.redis_url,
                timeout=config.redis_timeout,
                prefix=config.key_prefix,
                on_state=on_redis_state,
            )
            if on_redis_state is not None:
                on_redis_state("state", "closed", "closed")
        store: ConversationStore = (
            RedisConversations(self.redis, config.conversations)
            if self.redis is not None
            else MemoryConversations(config.conversations)
        )
        self.conversations: Conversations | None = (
            Conversations(store, config.conversations) if config.conversations.enabled else None
        )
        self.records: RecordStore | None = None
        """Background responses' records (with stored conversations only)."""
        self.events: EventLog | None = None
        """Background streams' events, for a client that resumes one."""
        if self.conversations is not None:
            self.records = (
                RedisRecords(self.redis, config.conversations)
                if self.redis is not None
                else MemoryRecords(config.conversations)
            )
            self.events = (
                RedisEvents(self.redis, config.conversations)
                if self.redis is not None
                else MemoryEvents(config.conversations)
            )
        self.stored = StoredObjects(self.conversations, self.records)
        self.completions: StoredCompletions | None = None
        """Chat completions asked to be kept (`store: true`), with stored conversations only."""
        if self.conversations is not None:
            kept: CompletionStore = (
                RedisCompletions(self.redis, config.conversations)
                if self.redis is not None
                else MemoryCompletions(config.conversations)
            )
            self.completions = StoredCompletions(kept, config.conversations)
        """Stored responses and conversations read back and deleted by id."""
        self.cache: ResponseCache | None = None
        if config.cache.enabled:
            tiers: list[CacheTier] = []
            if self.redis is not None and config.cache.l2:
                tiers.append(RedisTier(self.redis, config.cache.ttl))
            self.cache = ResponseCache(config.cache, tiers=tiers, registry=registry)
        self.turns = Counter(
            "quicedge_conversation_turns_total",
            "Stored-conversation turns by outcome (committed, failed, lost, busy, not_found, "
            "too_large, unavailable)",
            ["outcome"],
            registry=registry,
        )
        self.completions_kept = Counter(
            "quicedge_stored_completions_total",
            "Chat completions asked to be stored (store: true), by outcome (stored, too_large, "
            "incomplete, unavailable)",
            ["outcome"],
            registry=registry,
        )
        self.background_ended = Counter(
            "quicedge_background_responses_total",
            "Background responses by how they ended (completed, failed, cancelled)",
            ["outcome"],
            registry=registry,
        )
        self.running = 0
        """Background answers this process is generating (`queue` to their end)."""
        self._settling: set[asyncio.Task[None]] = set()
        """Background responses' final records waiting for Redis (`settle_later`)."""
        self.background_running = Gauge(
            "quicedge_background_responses_running",
            "Background responses this process is generating now",
            registry=registry,
        )

    async def aclose(self) -> None:
        for task in list(self._settling):
            task.cancel()
        if self._settling:
            await asyncio.wait(self._settling, timeout=1.0)
        if self.redis is not None:
            await self.redis.aclose()

    def settle_later(self, write: Callable[[], Awaitable[object]], request_id: str) -> None:
        """Write a background response's final record in the background, when the breaker
        closes and then after each of `SETTLE_RETRIES_S`: a record left `in_progress` would
        be polled for as long as records live. Past them, its heartbeat runs out instead
        (`BEAT_S`), and readers report it failed all the same."""
        if len(self._settling) >= MAX_SETTLING:
            log.warning("request %s: its background record is left to its heartbeat: %d "
                        "others wait for Redis", request_id, len(self._settling))  # fmt: skip
            return
        task = asyncio.get_running_loop().create_task(self._settle(write, request_id))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def _settle(self, write: Callable[[], Awaitable[object]], request_id: str) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + sum(SETTLE_RETRIES_S)
        for wait in SETTLE_RETRIES_S:
            await asyncio.sleep(wait)
            # an open breaker refuses without a round trip: try as soon as its probe closes it
            while self.redis is not None and not self.redis.guard.usable:
                if loop.time() >= deadline:
                    break
                await asyncio.sleep(SETTLE_POLL_S)
            try:
                await write()
            except StateUnavailable:
                continue
            log.info("request %s: its background record was written after all", request_id)
            return
        log.warning("request %s: its background record was not written; it reads failed "
                    "once its heartbeat runs out", request_id)  # fmt: skip

    async def prepare(
        self, ex: Exchange, raw: bytes, body: dict[str, Any]
    ) -> tuple[bytes, dict[str, Any]]:
        """The body to forward (rebuilt for a conversation or `/v1/responses`), and `ex.state`."""
        keep = None
        try:
            if ex.route == RESPONSES:
                return await self._responses(ex, body)
            if ex.route == CHAT and self.completions is not None:
                keep = check_store(body)
            if ex.headers.conversation is not None:
                raw, body = await self._chat_conversation(ex, body, ex.headers.conversation)
                if keep is not None:
                    self._keep(ex, keep, body)
                return raw, body
        except EdgeError as err:
            if not isinstance(err, InvalidRequest) or err.param not in ("store", "metadata"):
                self.turns.labels(_outcome_of(err)).inc()
            raise
        if keep is not None:  # its answer is stored, so it is not one from the cache
            self._keep(ex, keep, body)
            return raw, body
        cache = self.cache
        if cache is not None and ex.route in CACHEABLE_ROUTES:
            opt = ex.headers.cache
            wanted = opt == b"use" or (opt != b"off" and ex.route in cache.config.routes)
            if wanted and cache.config.allows(ex.tenant) and deterministic(ex.route, body):
                model = body.get("model")
                request = StateRequest(self, ex)
                request.cache_model = model if isinstance(model, str) else ""
                request.cached = body  # keyed in `begin`, as policy and routing left it
                ex.state = request
        return raw, body

    def _keep(self, ex: Exchange, metadata: dict[str, str], body: dict[str, Any]) -> None:
        """Have this chat request's answer stored (`store: true`) once it completes."""
        state = ex.state if ex.state is not None else StateRequest(self, ex)
        state.keep = metadata
        messages = body.get("messages")
        state.sent = messages if isinstance(messages, list) else []
        if state.answer is None:  # a stream's message, calls and finish, gathered as it goes
            state.answer = ChatAnswer()
        ex.state = state

    def _conversations(self) -> Conversations:
        if self.conversations is None:
            raise InvalidRequest(
                "stored conversations are turned off on this edge",
                code="conversations_disabled",
            )
        return self.conversations

    async def _responses(self, ex: Exchange, body: dict[str, Any]) -> tuple[bytes, dict[str, Any]]:
        request = parse_request(body)
        turn: Turn | None = None
        if request.previous is not None:
            cid, number = parse_response_id(request.previous)
            turn = await self._conversations().resume(
                ex.tenant, cid, request.new, after=number, store=request.store,
                truncate=request.truncate, missing=previous_not_found(request.previous),
            )  # fmt: skip
        elif request.conversation is not None:
            missing = ConversationNotFound(
                f"Conversation with id '{request.conversation[:80]}' not found.",
                param="conversation",
            )
            try:
                cid = parse_conversation_name(request.conversation)
            except ConversationNotFound:
                raise missing from None
            turn = await self._conversations().resume(
                ex.tenant, cid, request.new, store=request.store, truncate=request.truncate,
                missing=missing,
            )  # fmt: skip
        elif request.store and self.conversations is not None:
            turn = await self.conversations.start(ex.tenant, request.new, truncate=request.truncate)
        if turn is not None and request.truncate is None:  # the edge's choice, said as OpenAI's
            request.echo["truncation"] = "auto" if turn.truncate else "disabled"
        if turn is not None and turn.token is not None:
            rid = response_id(turn.cid, turn.number)
        else:
            rid = "resp_" + os.urandom(16).hex()  # not stored: nothing can continue it
        state = StateRequest(self, ex, turn=turn)
        state.builder = ResponseBuilder(request.echo, rid, request.model or "default")
        if request.background:
            limit = self.config.conversations.background_running
            if self.running >= limit:
                if turn is not None and self.conversations is not None:
                    await self.conversations.release(turn)  # it will not run: its turn goes
                raise Overloaded(
                    f"{limit} background responses are running on this edge; retry later",
                    headers=((b"retry-after", b"1"),),
                )
            if turn is None:
                raise InvalidRequest(
                    "background responses need stored conversations, which are turned off "
                    "on this edge", param="background", code="conversations_disabled",
                )  # fmt: skip
            state.background = True
        ex.state = state
        ex.route = CHAT
        chat = request.chat_body(turn.messages if turn is not None else request.new)
        return orjson.dumps(chat), chat

    async def _chat_conversation(
        self, ex: Exchange, body: dict[str, Any], header: bytes
    ) -> tuple[bytes, dict[str, Any]]:
        if ex.route != CHAT:
            raise InvalidRequest(
                f"{CONVERSATION_HEADER} is only for /v1/chat/completions",
                param=CONVERSATION_HEADER,
            )
        new = body.get("messages")
        if not isinstance(new, list) or not new or not all(isinstance(m, dict) for m in new):
            raise InvalidRequest(
                "'messages' must be a non-empty list of the new turn's messages",
                param="messages",
            )
        conversations = self._conversations()
        value = header.decode("latin-1").strip()
        if value == NEW:
            turn = await conversations.start(ex.tenant, new)
        else:
            turn = await conversations.resume(
                ex.tenant, parse_conversation_name(value), new,
                missing=ConversationNotFound(
                    f"Conversation with id '{value[:80]}' not found.", param=CONVERSATION_HEADER
                ),
            )  # fmt: skip
        state = ex.state = StateRequest(self, ex, turn=turn)
        # The reply may be tool calls, kept whole, not as text only; with `n` > 1 the stream
        # interleaves the choices, and the turn keeps the first (the scanner joins them all).
        if body.get("tools") or body.get("n") not in (None, 1):
            state.answer = ChatAnswer()
        messages = turn.messages
        # the messages member keeps its place: the body differs from the client's only there
        rebuilt = {k: (messages if k == "messages" else v) for k, v in body.items()}
        return orjson.dumps(rebuilt), rebuilt


def _outcome_of(err: EdgeError) -> str:
    return {404: "not_found", 409: "busy", 413: "too_large", 503: "unavailable"}.get(
        err.status, "invalid"
    )


class StateRequest:
    """The state side of one request: the turn it holds, the cache key, the answer going by."""

    __slots__ = (
        "answer",
        "answer_failed",
        "others",
        "background",
        "background_error",
        "beat_at",
        "builder",
        "cancelled",
        "detached",
        "content_type",
        "cache_key",
        "cache_model",
        "cached",
        "captured",
        "captured_size",
        "committed",
        "ended",
        "ex",
        "head",
        "chunk_ids",
        "held",
        "keep",
        "queued",
        "normalised",
        "refused",
        "replay_cut",
        "scanner",
        "sent",
        "stage",
        "status",
        "turn",
        "turn_settled",
        "usage",
        "whole",
        "_send",
    )

    def __init__(self, stage: StateStage, ex: Exchange, *, turn: Turn | None = None) -> None:
        self.stage = stage
        self.ex = ex
        self.turn = turn
        self.builder: ResponseBuilder | None = None
        self.answer: ChatAnswer | None = None
        """A chat conversation's answer when tools were offered (its calls are kept too)."""
        self.answer_failed = False
        self.cache_key: str | None = None
        self.cache_model = ""
        self.cached: dict[str, Any] | None = None
        """The body of a request whose answer may come from (or go to) the cache."""
        self.normalised = b""
        self.captured: list[bytes] | None = None
        self.captured_size = 0
        self.scanner: SSEScanner | None = None
        self.status = 0
        self.content_type = b"application/json"
        self.ended = False
        self.turn_settled = False
        """Its turn was committed or released (as the answer's end went out, or at `finish`)."""
        self.committed = False
        self.held: MutableMapping[str, Any] | None = None
        self.whole: list[bytes] = []
        self._send: Send | None = None
        self.background = False
        """A `background: true` response: generated without its client (`edge.app`)."""
        self.background_error: dict[str, Any] | None = None
        """Why a background answer failed before its backend answered (`{"code", "message"}`)."""
        self.cancelled = False
        """A background answer stopped by `POST /v1/responses/{id}/cancel`."""
        self.queued = False
        """A background answer's record was written: it is settled when it ends."""
        self.replay_cut: str | None = None
        """The stream rule that cut an answer replayed from the cache (None: none did)."""
        self.refused: str | None = None
        """A backend's 4xx refusal of this `/v1/responses` request, as its client read it."""
        self.beat_at = 0.0
        """When its heartbeat is renewed next (`cancel_requested`; monotonic s)."""
        self.detached = False
        """A background answer's task owns this request now (and finishes it)."""
        self.keep: dict[str, str] | None = None
        """A chat request's `store: true`: the metadata its stored answer gets."""
        self.sent: list[Any] = []
        """What a stored chat request sent (its `messages`)."""
        self.head: dict[str, Any] | None = None
        """A stored stream's `id`, `created` and `model`, from its first chunk."""
        self.chunk_ids: set[str] = set()
        """A stored stream's chunks' ids (SGLang gives each choice of `n` > 1 its own): each
        reads the stored completion back."""
        self.usage: Any = None
        """A stored stream's `usage`, when a chunk gave it."""
        self.others: dict[int, ChatAnswer] = {}
        """A stored stream's choices past the first (`n` > 1), by index."""

    async def queue(self) -> dict[str, Any]:
        """Record a background response as running; the `queued` response object its client
        gets now."""
        assert self.builder is not None and self.stage.records is not None
        meta = self.builder.stored()
        turn = self.turn
        sent = [] if turn is None else [list(p) for p in turn.history.next_input(turn.new)]
        lease = None if turn is None or turn.token is None else turn.token.hex()
        record = Record(RUNNING, meta, sent=sent, lease=lease)
        stage, limit = self.stage, self.stage.config.conversations.background_running
        if stage.running >= limit:  # others admitted with this one got there first
            raise Overloaded(
                f"{limit} background responses are running on this edge; retry later",
                headers=((b"retry-after", b"1"),),
            )
        stage.running += 1  # counted before the record's write: the check above holds
        try:
            assert stage.records is not None
            await stage.records.start(self.ex.tenant, self.builder.id, record)
        except BaseException:
            stage.running -= 1
            raise
        self.beat_at = time.monotonic() + BEAT_EVERY_S
        self.queued = True
        stage.background_running.inc()
        return self.builder.response("queued")

    async def keep_lease(self) -> bool:
        """Renew this background turn's lease; False once it is lost (never raises)."""
        conversations, turn = self.stage.conversations, self.turn
        if conversations is None or turn is None:
            return True
        try:
            return await conversations.extend(turn)
        except StateUnavailable:
            return True  # tried again at the next renewal

    async def cancel_requested(self) -> bool:
        """Whether a cancel or a delete was recorded for this background response (never
        raises); every `BEAT_EVERY_S` the same round trip renews its heartbeat (this edge
        still runs it)."""
        records = self.stage.records
        assert self.builder is not None and records is not None
        tenant, rid = self.ex.tenant, self.builder.id
        try:
            if time.monotonic() >= self.beat_at:
                record = await records.beat(tenant, rid)
                self.beat_at = time.monotonic() + BEAT_EVERY_S
            else:
                record = await records.get(tenant, rid)
        except StateUnavailable:
            return False  # asked again at the next poll
        return record is not None and record.status in (CANCELLED, DELETED)

    def _settlement(self, committed: bool) -> Callable[[], Awaitable[object]]:
        """A background response ended: counted now; what writes its record (it goes once its
        answer is stored, and says why when it is not; a deleted one's stays deleted)."""
        stage, builder = self.stage, self.builder
        records = stage.records
        assert builder is not None and records is not None
        stage.background_running.dec()
        stage.running -= 1
        tenant, rid = self.ex.tenant, builder.id
        if committed:
            stage.background_ended.labels("completed").inc()
            return lambda: records.delete(tenant, rid)
        meta = builder.stored()
        turn = self.turn
        sent = [] if turn is None else [list(p) for p in turn.history.next_input(turn.new)]
        if self.cancelled:
            stage.background_ended.labels("cancelled").inc()
            cancelled = Record(CANCELLED, meta, sent=sent)
            return lambda: records.settle(tenant, rid, cancelled)
        error = self.background_error or builder.failed
        if error is None and self.status not in (0, 200):
            answered = self.refused or f"the backend answered {self.status}"
            error = {"code": "backend_error", "message": answered}
        if error is None:
            lost = "the answer completed, but its conversation was deleted or its lease expired"
            error = {"code": "not_stored", "message": lost}
        stage.background_ended.labels("failed").inc()
        failed = Record(FAILED, meta, error, sent)
        # a cancel recorded meanwhile (its answer said `cancelled`) is what stays
        return lambda: records.settle(tenant, rid, failed, keep_cancelled=True)

    async def begin(
        self, send: Send, whole: Callable[[Exchange, bytes], bytes] | None = None
    ) -> Send | None:
        """Answer from the cache (None: answered), or the `send` the relay should use.
        `whole`: the stream rules over a whole answer (`PolicyGateway.whole`), for one
        replayed from the cache."""
        ex, cache = self.ex, self.stage.cache
        if self.cached is not None and cache is not None:
            # The body as the backend gets it: a request rule redacts or caps it in place
            # (`PolicyGateway.stage`), and an answer to another body is not this one's.
            self.normalised = cache.normalise(self.cached)
            self.cache_key = self._cache_key(cache)
            found = await cache.get(self.cache_key)
            if found is not None:
                entry, tier = found
                await self._replay(send, entry, tier, whole)
                return None
            self.captured = []
        ex.body_writer = None  # relay through `send`, where this request sees the answer
        if ex.stream and self.builder is None and self.answer is None:
            self.scanner = SSEScanner.for_route(ex.route)
        self._send = send
        return self.send

    def _cache_key(self, cache: ResponseCache, answered: str | None = None) -> str:
        """The key for the pool and version routing chose (`ex.model_route`, known only after
        `prepare`): a gray release's stable and canary, or an alias a reload pointed at
        another pool, never share an entry. At `finish`, a canary that fell back to stable
        has stable's route, so its answer is stored as stable's."""
        ex, route = self.ex, self.ex.model_route
        pool = (route.pool or "") if route is not None else ""
        served = (route.version or "") if route is not None else ""
        return cache.key(ex.tenant, ex.route, self.cache_model, self.normalised, pool=pool,
                         served=served, answered=answered)  # fmt: skip

    async def _replay(
        self,
        send: Send,
        entry: Entry,
        tier: str,
        whole: Callable[[Exchange, bytes], bytes] | None,
    ) -> None:
        ex, stream, body = self.ex, entry.stream, entry.body
        guard = ex.stream_guard if stream else None
        if guard is not None:  # the stream rules in force now, not those it was stored under
            body = guard.feed(body)
            if guard.cut is None:
                body += guard.finish()
            self.replay_cut = guard.cut  # noted, counted and traced by the app's gateway
        elif not stream and whole is not None:  # as over a fresh whole answer (it counts)
            body = whole(ex, body)
        headers = [
            (b"content-type", entry.content_type),
            (b"x-request-id", ex.request_id.encode()),
            (_CACHE_HEADER, b"hit-" + tier.encode()),
            *(ex.ratelimit or ()),
        ]
        if not stream:
            headers.append((b"content-length", b"%d" % len(body)))
        ex.started = True
        ex.status = 200
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        ex.responded = True
        await send({"type": "http.response.body", "body": body, "more_body": False})

    def _extra_headers(self) -> list[tuple[bytes, bytes]]:
        extra = []
        if self.captured is not None:
            extra.append((_CACHE_HEADER, b"miss"))
        turn = self.turn
        if turn is not None and self.builder is None:
            extra.append((_CONV_HEADER, conversation_name(turn.cid).encode()))
            if turn.truncated:
                extra.append((b"x-quicedge-conversation-truncated", b"true"))
        return extra

    async def send(self, message: MutableMapping[str, Any]) -> None:
        """The relay's `send`: watch (and for `/v1/responses` translate) the answer."""
        assert self._send is not None
        kind = message["type"]
        if kind == "http.response.start":
            self.status = message["status"]
            for name, value in message["headers"]:
                if name == b"content-type":
                    self.content_type = value
            if self.status == 200:
                message = {**message, "headers": [*message["headers"], *self._extra_headers()]}
                if self.builder is not None and not self.ex.stream:
                    self.held = message  # its content-length changes with the translation
                    return
            elif self.builder is not None and self.status >= 400:
                self.held = message  # a refusal or failure, in OpenAI's shape (`_refused`)
                return
            await self._send(message)
            return
        if kind != "http.response.body":
            await self._send(message)
            return
        body: bytes = message.get("body", b"")
        more = bool(message.get("more_body", False))
        if self.status == 200:
            body = self._watch(body, more)
            if self.held is not None:
                if more:
                    return
                start, self.held = self.held, None
                start["headers"] = [
                    (k, v) for k, v in start["headers"] if k != b"content-length"
                ] + [(b"content-length", b"%d" % len(body))]
                await self._send(start)
        elif self.held is not None:
            body = self._refused(body, more)
            if more:
                return
            start, self.held = self.held, None
            start["headers"] = [
                (k, v) for k, v in start["headers"] if k not in (b"content-length", b"content-type")
            ] + [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
            await self._send(start)
        if not more:
            self.ended = True
        if self.turn is not None and not self.turn_settled and self._over(more):
            # Committed before the client has the answer's end: a client that sends its next
            # turn at once (an agent's loop) found the conversation still held, 409.
            await self._settle_turn(self.status == 200 and self._complete(ending=True))
        await self._send({**message, "body": body, "more_body": more})

    def _over(self, more: bool) -> bool:
        """The answer's end is in the chunk about to go out (a stream's end event may come
        before the last, empty, body message)."""
        if not more:
            return True
        if self.status != 200:
            return False
        if self.builder is not None:
            return self.builder.ended
        if self.scanner is not None:
            return self.scanner.done
        if self.answer is not None and self.ex.stream:
            return self.answer.done
        return False

    def _refused(self, body: bytes, more: bool) -> bytes:
        """A backend's 4xx or 5xx answer to a `/v1/responses` request, read whole (up to
        `MAX_REFUSAL_BYTES`): `/v1/responses` is the edge's own endpoint, so the client gets
        OpenAI's error object about the fields it sent (`refusal`), not the backend's about
        the chat request it never made. A background response's record keeps its message."""
        if sum(map(len, self.whole)) < MAX_REFUSAL_BYTES:
            self.whole.append(body)
        if more:
            return b""
        error = refusal(self.status, b"".join(self.whole))
        self.refused = f"the backend answered {self.status}: {error['error']['message']}"
        return orjson.dumps(error)

    def _watch(self, body: bytes, more: bool) -> bytes:
        """Record one chunk of a 200 answer; return what the client gets for it."""
        captured = self.captured
        if captured is not None and body:
            self.captured_size += len(body)
            if self.captured_size <= self.stage.config.cache.max_entry_bytes:
                captured.append(body)
            else:
                self.captured = None  # too large to store: relayed only
        if self.scanner is not None and body:
            self.scanner.feed(body)
        answer = self.answer
        if answer is not None and self.ex.stream and body:
            for obj in answer.feed(body):
                if isinstance(obj, dict) and "error" in obj:
                    self.answer_failed = True
                elif isinstance(obj, dict):
                    answer.take_chunk(obj)
                    if self.keep is not None:
                        self._note(obj)
        builder = self.builder
        if builder is None:
            if not self.ex.stream and (self.turn is not None or self.keep is not None):
                self.whole.append(body)
            return body
        if not self.ex.stream:
            self.whole.append(body)
            if more:
                return b""
            whole = b"".join(self.whole)
            return builder.from_chat_body(whole) or whole
        out = builder.feed(body)
        if not more and not builder.ended:
            builder.failed = {"code": "stream_cut", "message": "the backend's stream ended early"}
            out += builder.finish()
        return out

    def _note(self, chunk: dict[str, Any]) -> None:
        cid = chunk.get("id")
        if isinstance(cid, str):
            if self.head is None:
                self.head = {k: chunk.get(k) for k in ("id", "created", "model")}
            if len(self.chunk_ids) <= MAX_CHOICES:
                self.chunk_ids.add(cid)
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        choices = chunk.get("choices")
        if isinstance(choices, list):  # with `n` > 1, the other choices are kept too
            for choice in choices:
                index = choice.get("index") if isinstance(choice, dict) else None
                if isinstance(index, int) and 0 < index <= MAX_CHOICES:
                    other = self.others.get(index)
                    if other is None:
                        other = self.others[index] = ChatAnswer()
                    other.take_choice(choice)

    def _completion(self) -> dict[str, Any] | None:
        """The `chat.completion` object to store for this answer (None: none to store)."""
        if not self.ex.stream:
            try:
                whole = orjson.loads(b"".join(self.whole))
            except ValueError:
                return None
            return whole if isinstance(whole, dict) and whole.get("choices") else None
        answer = self.answer
        if answer is None or self.head is None:
            return None
        answers = [(0, answer), *sorted(self.others.items())]
        choices = [_choice(index, one) for index, one in answers]
        return {**self.head, "object": "chat.completion", "choices": choices,
                "usage": self.usage}  # fmt: skip

    async def _store_completion(self, complete: bool) -> None:
        stage = self.stage
        assert stage.completions is not None and self.keep is not None
        completion = self._completion() if complete else None
        if completion is None:
            stage.completions_kept.labels("incomplete").inc()
            return
        completion["metadata"] = self.keep
        try:
            kept = await stage.completions.keep(self.ex.tenant, completion, self.sent,
                                                self.chunk_ids)  # fmt: skip
        except StateUnavailable as err:
            stage.completions_kept.labels("unavailable").inc()
            log.warning("request %s: its completion was not stored: %s", self.ex.request_id, err)
            return
        stage.completions_kept.labels("stored" if kept else "too_large").inc()

    def _complete(self, *, ending: bool = False) -> bool:
        """The client got a whole, successful answer (a stream that reached its end cleanly);
        `ending`: its end is about to go out."""
        ex = self.ex
        if self.status != 200 or not (self.ended or ending):
            return False
        if ex.error is not None or ex.disconnected:
            return False
        if self.builder is not None:
            return self.builder.ended and self.builder.failed is None
        if self.scanner is not None:
            return self.scanner.done and self.scanner.error is None
        if self.answer is not None and ex.stream:
            return self.answer.done and not (self.answer_failed or self.answer.oversized)
        return True

    def _reply(self) -> dict[str, Any] | None:
        """The answer as the assistant message its conversation stores; None: no answer."""
        if self.builder is not None:
            return self.builder.reply()
        if self.answer is not None:
            if not self.ex.stream:
                message = message_of_body(b"".join(self.whole))
                if message is None:
                    return None
                self.answer.take_message(message)
            return self.answer.reply()
        if self.scanner is not None:
            text = self.scanner.final()[1]
        else:
            text = answer_of_body(b"".join(self.whole))[1]
        return None if text is None else {"role": "assistant", "content": text}

    async def _settle_turn(self, complete: bool) -> None:
        """Commit the turn (`complete`) or release it, once. Never raises."""
        stage, turn = self.stage, self.turn
        self.turn_settled = True
        try:
            if turn is not None and stage.conversations is not None:
                reply = self._reply() if complete else None
                if reply is not None:
                    meta = self.builder.stored() if self.builder is not None else None
                    self.committed = await stage.conversations.commit(turn, reply, meta)
                    stage.turns.labels("committed" if self.committed else "lost").inc()
                else:
                    await stage.conversations.release(turn)
                    stage.turns.labels("failed").inc()
        except StateUnavailable as err:
            stage.turns.labels("unavailable").inc()
            log.warning("request %s: its turn was not stored: %s", self.ex.request_id, err)
            if self.queued and self.background_error is None:
                stored = f"the answer completed, but it could not be stored: {err.message}"
                self.background_error = {"code": "state_unavailable", "message": stored}

    async def finish(self) -> None:
        """Commit the turn or release it (unless that was done as the answer's end went out);
        store a complete answer. Never raises."""
        stage = self.stage
        complete = self._complete()
        if not self.turn_settled:
            await self._settle_turn(complete)
        committed = self.committed
        if self.keep is not None:
            await self._store_completion(complete)
        if self.queued and not committed and not self.cancelled:
            # A cancel recorded after the last poll (it released the lease, so the commit
            # wrote nothing): the response ends cancelled, as the cancel answered.
            self.cancelled = await self.cancel_requested()
        if self.queued:
            write = self._settlement(committed)
            try:
                await write()
            except StateUnavailable as err:
                log.warning("request %s: its background record was not written: %s; "
                            "tried again as Redis answers", self.ex.request_id, err)  # fmt: skip
                stage.settle_later(write, self.ex.request_id)
        cache = stage.cache
        if cache is None or self.cache_key is None or self.status == 0:
            return  # not cached, answered from the cache, or failed before any answer
        if not complete or self.captured is None:
            if self.status == 200:
                cache.stores.labels("incomplete" if not complete else "too_large").inc()
            return
        body = b"".join(self.captured)
        if self.ex.policy_decision == "filtered" or aborted(
            self.ex.route, body, stream=self.ex.stream
        ):  # cut by a stream rule (the policy's answer, not the model's), or by its backend
            cache.stores.labels("incomplete").inc()
            return
        # The version that gave it: its backend's as the edge knows it (`/get_model_info`, the
        # config), which keys look-ups too (`ResponseCache.key`), else the one it reports.
        backend = self.ex.backend
        answered = known_version(backend.model_version if backend is not None else None) or (
            known_version(self._reported_version(body)))  # fmt: skip
        if answered and answered != cache.version(self.cache_model):
            cache.learn(self.cache_model, answered)
        key = self._cache_key(cache, answered)
        await cache.put(key, stream=self.ex.stream, body=body, content_type=self.content_type)

    def _reported_version(self, body: bytes) -> str | None:
        if not self.ex.stream:
            return _weight_version(self.ex.route, body)
        if self.scanner is not None and self.ex.route == GENERATE:
            last = self.scanner.last_data
            return _weight_version(GENERATE, last) if last is not None else None
        return None


__all__ = ["StateRequest", "StateStage"]
