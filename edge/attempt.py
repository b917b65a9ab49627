"""Trying backends for one request: route, send, relay, observe; retry while nothing was sent.

`Attempts.run` asks the routing policy for a backend, sends the request through the pool and
relays the answer (`edge.relay`), and moves on to another backend when an attempt fails before
anything reached the client (a connect failure, a broken connection, a busy pool, a 429/502/503).
Every attempt is observed by the policy exactly once, whatever happens to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, MutableMapping
from functools import partial
from typing import Any

from backends.credentials import BackendCredentials
from backends.errors import (
    UpstreamConnectError,
    UpstreamError,
    UpstreamPoolBusy,
    UpstreamProtocolError,
    UpstreamTimeout,
)
from backends.pool import UpstreamPool, UpstreamResponse
from backends.registry import Backend, BackendRegistry, InFlight
from edge.admission import Admission
from edge.admission.headers import retry_after
from edge.asgi import Send
from edge.config import ProxyConfig
from edge.errors import (
    BadGateway,
    CircuitOpen,
    EdgeError,
    NoHealthyBackend,
    Overloaded,
    TooManyRequests,
    from_upstream,
)
from edge.exchange import Exchange
from edge.models.pools import Route
from edge.models.service import Models
from edge.policy.gateway import PolicyGateway
from edge.relay import RelayResult, StreamRelay, read_whole
from edge.routing.base import Decision, Outcome, RoutingPolicy
from edge.routing.breaker import serves
from edge.routing.breakers import STATE_NAMES, BreakerConfig, Breakers, Ticket
from edge.sse import Usage, answer_of_body
from edge.stages.account import account_cache, account_stream
from edge.stages.body import BodyBudget
from edge.stages.forward import response_headers
from edge.telemetry import Metrics

Aborter = Callable[[Backend, str], None]
"""Fire-and-forget `/abort_request` for (backend, rid); must not block the caller."""

RETRY_STATUSES = frozenset({429, 502, 503})
"""Upstream answers worth another backend while nothing reached the client (overloaded/down)."""
MAX_UPSTREAM_BODY = 64 * 1024 * 1024
"""Largest non-streaming backend answer the edge holds (64 MiB)."""
REFUSAL_BODY_LIMIT = 64 * 1024
"""The most of a 429/502/503's body read before a retry to keep its connection reusable."""
REFUSAL_BODY_TIMEOUT = 1.0
"""How long that read may take; a refusal's body larger or slower costs its connection."""
_RETRY_KINDS = {"429": "429", "502": "5xx", "503": "5xx"}
"""A retry's reason (a status or an UpstreamError kind) as an outcome kind."""
_RETRY_BEFORE_SEND = (UpstreamConnectError, UpstreamProtocolError, UpstreamPoolBusy)
"""Failures before the response head that another backend may not share."""


class _Retry(Exception):
    """This attempt failed before anything reached the client; another backend may serve."""

    def __init__(self, error: EdgeError, reason: str) -> None:
        super().__init__(error.message)
        self.error = error
        self.reason = reason


class Attempts:
    """The backends tried for each request, in turn, and what each attempt did."""

    def __init__(
        self,
        *,
        config: ProxyConfig,
        pool: UpstreamPool,
        registry: BackendRegistry,
        policy: RoutingPolicy,
        metrics: Metrics,
        abort: Aborter,
        admission: Admission,
        gateway: PolicyGateway | None = None,
        breakers: Breakers | None = None,
        credentials: BackendCredentials | None = None,
        models: Models | None = None,
        answer_budget: BodyBudget | None = None,
    ) -> None:
        self.credentials = credentials or BackendCredentials()
        self.answer_budget = answer_budget
        """What non-streamed answers hold in this process, and its cap (None: no cap)."""
        self.admission = admission
        self.models = models
        self.config = config
        self.gateway = gateway
        self.pool = pool
        self.registry = registry
        self.policy = policy
        self.metrics = metrics
        self.abort = abort
        self.breakers = breakers or Breakers(BreakerConfig(enabled=False), registry.backends)
        self.expose = config.expose_backend_names
        self._active = 0
        """Requests in `run` now."""
        self._retrying = 0
        """Of them, those past their first attempt (`_may_retry`)."""

    def _in_pool(self, route: Route | None) -> list[Backend]:
        """The registry's candidates narrowed to the request's model pool and version."""
        able = self.registry.candidates()
        if self.models is None or route is None or not able:
            return able
        return self.models.candidates(route, able)

    def _allowed(self, tried: list[Backend], tier: str, route: Route | None) -> list[Backend]:
        """The backends of the request's pool not yet tried whose domain's breaker lets a
        request of `tier` through. A canary none of whose backends may take it (tried, or
        behind an open breaker) hands the request to the stable version."""
        untried = [b for b in self._in_pool(route) if b not in tried]
        allowed = self.breakers.allowed(untried, tier)
        if not allowed and route is not None and route.canary and self.models is not None:
            self.models.to_stable(route, refused=bool(untried))
            allowed = self.breakers.allowed(
                [b for b in self._in_pool(route) if b not in tried], tier
            )
        return allowed

    def _may_retry(self) -> bool:
        """Whether one more request may go on a retry (`[proxy] retry_budget`): those on one
        stay within the budget's share of the requests in flight, or its minimum."""
        limit = max(self.config.retry_budget_min, self.config.retry_budget * self._active)
        return self._retrying < limit

    async def run(self, ex: Exchange, send: Send) -> None:
        """Serve `ex` from the first backend that answers; raise the last error if none does."""
        self._active += 1
        try:
            tried: list[Backend] = []
            last: _Retry | None = None
            # A failed attempt that was retried counts against its domain only when the request was
            # not then served in that same domain (a bad backend there is the registry's to eject).
            retried: list[tuple[Ticket, str]] = []
            assert ex.view is not None
            tier = ex.tier
            for attempt in range(self.config.max_retries + 1):
                candidates = await self.admission.place(
                    ex, partial(self._allowed, tried, tier, ex.model_route)
                )
                if not candidates:
                    self._settle(retried, None)
                    if last is not None:
                        raise last.error
                    untried = [b for b in self._in_pool(ex.model_route) if b not in tried]
                    if untried:
                        raise self._circuit_open(tier, untried)
                    if self.models is not None and ex.model_route is not None:
                        if self.registry.candidates():  # others can, not this pool: 503 naming it
                            raise self.models.pools.no_backend(ex.model_route)
                    raise self._no_candidate()
                t_route = time.perf_counter()
                decision = self.policy.choose(ex.view, candidates)
                t_routed = time.perf_counter()
                backend = decision.backend
                tried.append(backend)
                breaker = self.breakers.started(backend, tier)
                self.metrics.stage_route.observe(t_routed - t_route)
                self.metrics.decisions.labels(self.policy.name, decision.reason).inc()
                if ex.trace is not None:
                    attributes = {
                        "quicedge.backend": backend.name, "quicedge.reason": decision.reason,
                        "quicedge.predicted_cached_tokens": decision.predicted_cached_tokens,
                        "quicedge.model": backend.model or "",
                        "quicedge.model_version": backend.model_version or "",
                        "quicedge.hw_group": backend.hw_group,
                    }  # fmt: skip
                    if breaker is not None:
                        attributes["quicedge.breaker.domain"] = "/".join(breaker.key)
                        attributes["quicedge.breaker.state"] = STATE_NAMES[breaker.state]
                    ex.trace.stage("route", t_route, t_routed, attributes)
                prefill = ex.view.approx_tokens - decision.predicted_cached_tokens
                # the last try relays whatever the backend answers: no other backend is left to ask
                last_try = attempt == self.config.max_retries or len(candidates) == 1
                try:
                    with self.registry.track(backend, prefill_tokens=prefill) as in_flight:
                        await self._one(
                            ex,
                            backend,
                            decision,
                            in_flight,
                            send,
                            last_try=last_try,
                            breaker=breaker,
                        )
                    self._settle(retried, breaker)
                    return
                except _Retry as retry:
                    last = retry
                    if breaker is not None:
                        retried.append((breaker, retry.reason))
                    if not ex.retries and not self._may_retry():
                        self.metrics.retry_budget_exhausted.inc()
                        break
                    if not ex.retries:
                        self._retrying += 1  # a request on a retry, counted once (`run` frees it)
                    ex.retries += 1
                    self.metrics.retries.labels(retry.reason).inc()
                except BaseException:
                    self._settle(retried, breaker)
                    raise
            self._settle(retried, None)
            assert last is not None
            raise last.error
        finally:
            self._active -= 1
            if ex.retries:  # it went on a retry (`_may_retry`): one fewer now
                self._retrying -= 1

    def _settle(self, retried: list[tuple[Ticket, str]], served_by: Ticket | None) -> None:
        for ticket, reason in retried:
            if served_by is None or ticket.breaker is not served_by.breaker:
                self.breakers.ended(ticket, _RETRY_KINDS.get(reason, reason), None, held=False)

    async def _one(
        self,
        ex: Exchange,
        backend: Backend,
        decision: Decision,
        in_flight: InFlight,
        send: Send,
        *,
        last_try: bool,
        breaker: Ticket | None = None,
    ) -> None:
        """One backend: send, then relay; observe the outcome exactly once, whatever happens."""
        assert ex.view is not None
        ex.backend, ex.decision = backend, decision
        error: str | None = "cancelled"
        upstream_ttft: float | None = None
        usage = Usage()
        completion: str | None = None
        response: UpstreamResponse | None = None
        relay: StreamRelay | None = None
        on_head: Callable[[UpstreamResponse], None] | None = None
        if ex.stream and ex.body_writer is not None:
            # The head and the first token go on from the read callback that brings them.
            relay = _stream_relay(ex, in_flight)
            on_head = partial(_begin_relay, ex, backend, self.expose, relay)
        retrying = False
        headers = self.credentials.with_auth(backend.url, ex.upstream_headers)
        t_send = time.perf_counter()
        client_span = None
        if ex.trace is not None:  # the attempt as a CLIENT span, the backend's parent
            client_span, headers = ex.trace.upstream(
                backend.url, ex.route, backend.name, t_send, headers
            )
        try:
            try:
                response = await self.pool.request(
                    backend.url, "POST", ex.route, headers=headers, body=ex.payload,
                    first_byte_timeout=self.config.first_byte_timeout,
                    chunk_timeout=self.config.chunk_timeout, on_head=on_head,
                )  # fmt: skip
            except UpstreamError as exc:
                error = exc.kind
                if isinstance(exc, UpstreamPoolBusy):
                    # the edge is short of connections: not the backend's failure
                    self.metrics.upstream_errors.labels(backend.name, exc.kind).inc()
                else:
                    self._upstream_failed(backend, exc.kind)
                if isinstance(exc, UpstreamTimeout | UpstreamProtocolError):
                    self._abort(ex, backend)  # it may have reached the backend
                if isinstance(exc, _RETRY_BEFORE_SEND) and not last_try:
                    raise _Retry(from_upstream(exc, expose=self.expose), exc.kind) from None
                raise from_upstream(exc, expose=self.expose) from None
            t_head = relay.began_at if relay is not None and relay.began_at else time.perf_counter()
            self.metrics.upstream_requests.labels(
                backend.name, "true" if response.reused else "false"
            ).inc()
            if ex.trace is not None:
                ex.trace.stage(
                    "upstream_connect", t_send, t_head,
                    {"quicedge.backend": backend.name, "quicedge.reused": response.reused},
                )  # fmt: skip
            status = response.status
            if status == 401:
                # The backend refused the edge's own key for it: a fault of the edge's set-up
                # that its client's key cannot mend, so never relayed as the client's 401.
                await _drain_refusal(response)
                error = "auth"
                self._upstream_failed(backend, error)
                refusal = _auth_error(backend, expose=self.expose)
                if not last_try:
                    raise _Retry(refusal, reason="401")
                raise refusal
            if status in RETRY_STATUSES and not last_try:
                await _drain_refusal(response)
                error = "429" if status == 429 else "5xx"
                self._upstream_failed(backend, error)
                refusal = _retry_error(backend, status, _pacing(response), expose=self.expose)
                raise _Retry(refusal, reason=str(status)) from None
            if ex.stream and status == 200 and not _event_stream(response):
                await _drain_refusal(response)
                error = "protocol"
                self._upstream_failed(backend, error)
                who = f"backend {backend.name}" if self.expose else "a backend"
                refusal = BadGateway(f"{who} answered a streamed request with no event stream")
                if not last_try:
                    raise _Retry(refusal, reason=error)
                raise refusal
            if ex.stream and status == 200:
                result = await self._relay(ex, response, backend, in_flight, send, t_head, relay)
                usage, completion = result.usage, result.text
                error = _stream_error(result)
                if result.first_upstream is not None:
                    upstream_ttft = result.first_upstream - t_send
                account_stream(self.metrics, ex, backend, result, t_send, upstream_ttft)
                ex.content_chunks = len(result.gaps) + (result.first_client is not None)
            else:
                budget = self.answer_budget
                try:
                    body = await read_whole(
                        response, MAX_UPSTREAM_BODY, within=self.config.chunk_timeout,
                        budget=budget,
                    )  # fmt: skip
                except UpstreamError as exc:
                    error = exc.kind
                    self._upstream_failed(backend, exc.kind)
                    if isinstance(exc, UpstreamTimeout):
                        self._abort(ex, backend)  # it may still be working on it
                    raise from_upstream(exc, expose=self.expose) from None
                except Overloaded:
                    error = "overloaded"  # the edge's room, not the backend's failure
                    raise
                held = len(body)
                try:
                    if ex.shadow_tap is not None and response.status == 200:
                        body = ex.shadow_tap.whole(body)  # a sampled request: its shadow's half
                    if self.gateway is not None and response.status == 200:
                        body = self.gateway.whole(ex, body)  # the stream rules, over it whole
                    usage, completion, error = await self._send_whole(ex, response, body, send)
                finally:
                    if budget is not None:
                        budget.give(held)
            if error is None:
                self.registry.record_success(backend, ttft_s=upstream_ttft)
            elif error == "4xx":
                self.registry.record_failure(backend, "4xx")
            account_cache(self.metrics, ex, decision, usage)
        except _Retry:
            retrying = True
            raise
        except asyncio.CancelledError:
            if ex.disconnected:
                error = "disconnect"
                self.registry.record_failure(backend, "disconnect")
                self._abort(ex, backend)
            elif ex.judge_refused:
                error = "refused"
                self._abort(ex, backend)
            raise
        finally:
            ex.error = error
            # The breaker first, and every report before the one await here: a probe slot
            # not given back (an observer that raised, a second cancellation during the
            # close) would keep its domain half-open, refusing, for good.
            if breaker is not None:
                if retrying:
                    self.breakers.release(breaker)  # `run` settles it with the request
                else:
                    uncached = (usage.prompt_tokens or 0) - (usage.cached_tokens or 0)
                    self.breakers.ended(breaker, error, upstream_ttft, uncached)
            if client_span is not None and ex.trace is not None:
                answered = response.status if response is not None else None
                ex.trace.end_upstream(client_span, time.perf_counter(), answered, error)
            self.policy.observe(
                Outcome(
                    backend=backend, view=ex.view, decision=decision, ttft_s=upstream_ttft,
                    prompt_tokens=usage.prompt_tokens, cached_tokens=usage.cached_tokens,
                    completion_text=completion if ex.view.choices == 1 else None, error=error,
                )
            )  # fmt: skip
            if self.models is not None:
                self.models.observe(
                    ex.model_route, backend, ttft_s=upstream_ttft, error=error, ex=ex
                )
            if response is not None and not response.complete:
                await response.aclose()  # aborts the upstream request (its connection closes)

    async def _send_whole(
        self, ex: Exchange, response: UpstreamResponse, body: bytes, send: Send
    ) -> tuple[Usage, str | None, str | None]:
        """Send an answer read whole (not streamed, or a stream that is not a 200); return its
        usage, its text and the failure kind (None: success)."""
        assert ex.backend is not None
        backend = ex.backend
        status = response.status
        ex.started = True
        out = response_headers(
            response.headers, request_id=ex.request_id,
            backend_name=backend.name if self.expose else None, ratelimit=ex.ratelimit,
        )  # fmt: skip
        out.append((b"content-length", b"%d" % len(body)))
        await send({"type": "http.response.start", "status": status, "headers": out})
        ex.responded = True
        await send({"type": "http.response.body", "body": body, "more_body": False})
        ex.status = status
        if status == 200:
            usage, completion = answer_of_body(body)
            return usage, completion, None
        error = "5xx" if status >= 500 else ("429" if status == 429 else "4xx")
        if status >= 500 or status == 429:  # as when it is retried (the 4xx is `_one`'s)
            self._upstream_failed(backend, error)
        return Usage(), None, error

    async def _relay(
        self,
        ex: Exchange,
        response: UpstreamResponse,
        backend: Backend,
        in_flight: InFlight,
        send: Send,
        t_head: float,
        relay: StreamRelay | None,
    ) -> RelayResult:
        if relay is None:
            relay = _stream_relay(ex, in_flight)
        ex.started = True
        ex.status = 200
        await relay.run(response, send, _start_of(ex, response, backend, self.expose))
        result = relay.result
        if result.filtered is not None:
            self._abort(ex, backend)  # its connection is closed already; this frees the slot
            if self.gateway is not None:
                self.gateway.filtered(ex, result.filtered)
        if result.upstream_error is not None:
            self._upstream_failed(backend, result.upstream_error.kind)
            if isinstance(result.upstream_error, UpstreamTimeout):
                self._abort(ex, backend)
        trace = ex.trace
        if trace is not None and result.first_client is not None:
            assert result.first_upstream is not None
            # the first token may have come in the same read as the head
            first_in = max(t_head, result.first_upstream)
            trace.stage("upstream_first_byte", t_head, first_in)
            trace.stage("first_byte_to_client", first_in, result.first_client)
            trace.stage("stream_end", result.first_client, result.end,
                        {"quicedge.chunks": len(result.gaps) + 1})  # fmt: skip
        return result

    def _circuit_open(self, tier: str, untried: list[Backend]) -> EdgeError:
        """503: backends are up, but every domain of this tier is behind an open breaker, or
        none of them serves the tier at all (their `tiers` labels leave it out)."""
        if not any(serves(b, tier) for b in untried):
            return NoHealthyBackend(
                f"no backend serves tier {tier} (their tiers labels leave it out)",
                code="tier_not_served",
            )
        wait = self.breakers.refused(tier, untried)
        return CircuitOpen(
            f"every backend serving tier {tier} is behind an open circuit breaker; retry later",
            headers=retry_after(wait),
        )

    def _no_candidate(self) -> EdgeError:
        """503, saying whether the fleet is down or only full (every backend at its cap)."""
        healthy = [b for b in self.registry.backends if b.healthy]
        if healthy and all(
            b.max_concurrency is not None and b.in_flight >= b.max_concurrency for b in healthy
        ):
            return NoHealthyBackend(
                "every backend is at its concurrency cap; retry shortly", code="at_capacity"
            )
        if healthy and all(b.held for b in healthy):
            return NoHealthyBackend("every healthy backend is drained for maintenance; retry later")
        return NoHealthyBackend("no healthy backend can take the request now")

    def _upstream_failed(self, backend: Backend, kind: str) -> None:
        self.metrics.upstream_errors.labels(backend.name, kind).inc()
        self.registry.record_failure(backend, kind)

    def _abort(self, ex: Exchange, backend: Backend) -> None:
        if ex.abort_rid is not None:
            self.abort(backend, ex.abort_rid)


def _begin_relay(
    ex: Exchange, backend: Backend, expose: bool, relay: StreamRelay, response: UpstreamResponse
) -> None:
    """`on_head`: a streamed 200 starts at once (anything else waits for the task, which
    may retry it elsewhere)."""
    if response.status == 200 and _event_stream(response):
        ex.started = True
        ex.status = 200
        relay.begin(response, _start_of(ex, response, backend, expose))


def _event_stream(response: UpstreamResponse) -> bool:
    """The answer is an event stream, as a streamed request's 200 must be (a proxy's HTML page
    or a JSON body relayed as one would be a broken stream the client takes for an answer)."""
    for name, value in response.headers:
        if name == b"content-type":
            return value.split(b";", 1)[0].strip().lower() == b"text/event-stream"
    return False


def _stream_error(result: RelayResult) -> str | None:
    if result.upstream_error is not None:
        return result.upstream_error.kind
    if result.backend_error is not None:
        return "backend_error"
    return None


def _stream_relay(ex: Exchange, in_flight: InFlight) -> StreamRelay:
    return StreamRelay(
        RelayResult(), route=ex.route, writer=ex.body_writer,
        on_first_token=in_flight.first_token, on_complete=ex.mark_responded,
        guard=ex.stream_guard, strip_usage=ex.strip_usage,
    )  # fmt: skip


def _start_of(
    ex: Exchange, response: UpstreamResponse, backend: Backend, expose: bool
) -> MutableMapping[str, Any]:
    """The client's `http.response.start` for a relayed 200."""
    return {
        "type": "http.response.start",
        "status": 200,
        "headers": response_headers(
            response.headers,
            request_id=ex.request_id,
            backend_name=backend.name if expose else None,
            ratelimit=ex.ratelimit,
        ),  # fmt: skip
    }


_PACING = frozenset({b"retry-after", b"retry-after-ms"})


def _pacing(response: UpstreamResponse) -> tuple[tuple[bytes, bytes], ...]:
    """A refusal's `Retry-After` (and `retry-after-ms`), for the answer the edge gives in its
    stead when it does not retry it: clients pace themselves on them."""
    return tuple((name, value) for name, value in response.headers if name in _PACING)


def _retry_error(
    backend: Backend,
    status: int,
    headers: tuple[tuple[bytes, bytes], ...] = (),
    *,
    expose: bool,
) -> EdgeError:
    who = f"backend {backend.name}" if expose else "a backend"
    message = f"{who} answered {status}"
    if status == 429:
        return TooManyRequests(message, headers=headers)
    if status == 503:
        return NoHealthyBackend(message, headers=headers)
    return BadGateway(message, headers=headers)


def _auth_error(backend: Backend, *, expose: bool) -> EdgeError:
    who = f"backend {backend.name}" if expose else "a backend"
    return BadGateway(
        f"{who} refused the edge's credentials for it (401): check [proxy] "
        "backend_api_key_file / [proxy.backend_api_key_files]",
        code="backend_unauthorized",
    )


async def _drain_refusal(response: UpstreamResponse) -> None:
    """Read a refusal's body, which keeps its connection reusable, unless it is larger or
    slower than a refusal's should be (the client waits for its retry meanwhile): then close
    the connection instead."""
    size = 0
    with contextlib.suppress(UpstreamError, TimeoutError):
        async with asyncio.timeout(REFUSAL_BODY_TIMEOUT):
            async for chunk in response:
                size += len(chunk)
                if size > REFUSAL_BODY_LIMIT:
                    break
    if not response.complete:
        response.abort()


__all__ = ["MAX_UPSTREAM_BODY", "RETRY_STATUSES", "Aborter", "Attempts"]
