"""The proxy's ASGI app: one request through parse → admit → route → forward → relay → account.

Each stage is a plain function (`edge.stages`, `edge.routing`, `edge.relay`); this module runs them
in order, times each one, retries on another backend while nothing has reached the client, and
renders every `EdgeError` in one place (`edge.asgi.render_error`). It runs unchanged under the H3
server, under hypercorn (H1/H2) and in-process in tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, MutableMapping
from functools import partial
from typing import Any

from backends.errors import (
    UpstreamConnectError,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamTimeout,
)
from backends.pool import UpstreamPool, UpstreamResponse
from backends.registry import Backend, BackendRegistry, Ticket
from edge.admission import Admission, AdmissionSettings
from edge.admission.tenants import Tenant
from edge.asgi import Receive, Scope, Send, lifespan, render_error, send_json
from edge.config import ProxyConfig
from edge.errors import (
    BadGateway,
    EdgeError,
    MethodNotAllowed,
    ModelNotFound,
    NoHealthyBackend,
    RouteNotFound,
    TooManyRequests,
    from_upstream,
)
from edge.exchange import Exchange, read_headers
from edge.models import ModelCatalog
from edge.relay import RelayResult, StreamRelay, Usage, answer_of_body, read_whole
from edge.routing.base import Decision, Outcome, RoutingPolicy
from edge.stages.account import account_cache, account_stream
from edge.stages.body import (
    ClientGone,
    check_content_type,
    declared_length,
    parse_json_object,
    read_body,
)
from edge.stages.forward import request_id_from, response_headers, splice_rid, upstream_headers
from edge.stages.validate import CHAT, COMPLETIONS, GENERATE, validate
from edge.stages.view import build_view
from edge.telemetry import Metrics, RequestTrace, Tracer

log = logging.getLogger(__name__)

Aborter = Callable[[Backend, str], None]
"""Fire-and-forget `/abort_request` for (backend, rid); must not block the caller."""

INFERENCE_ROUTES = (CHAT, COMPLETIONS, GENERATE)
RETRY_STATUSES = frozenset({429, 502, 503})
"""Upstream answers worth another backend while nothing reached the client (overloaded/down)."""
MAX_UPSTREAM_BODY = 64 * 1024 * 1024
"""Largest non-streaming backend answer the edge holds (64 MiB)."""
_TRANSPORT_BY_VERSION = {"3": "h3", "2": "h2", "2.0": "h2"}


class _Retry(Exception):
    """This attempt failed before anything reached the client; another backend may serve."""

    def __init__(self, error: EdgeError, reason: str) -> None:
        super().__init__(error.message)
        self.error = error
        self.reason = reason


class ProxyApp:
    """The ASGI app for the inference routes and `/v1/models`."""

    def __init__(
        self,
        *,
        config: ProxyConfig,
        pool: UpstreamPool,
        registry: BackendRegistry,
        policy: RoutingPolicy,
        metrics: Metrics,
        catalog: ModelCatalog,
        abort: Aborter,
        tracer: Tracer | None = None,
        admission: Admission | None = None,
    ) -> None:
        self.config = config
        self.pool = pool
        self.registry = registry
        self.policy = policy
        self.metrics = metrics
        self.catalog = catalog
        self.abort = abort
        self.tracer = tracer
        self.admission = admission or Admission(AdmissionSettings(), metrics=metrics)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            await lifespan(receive, send)
            return
        if kind != "http":
            return
        path: str = scope["path"]
        method: str = scope["method"]
        route = path if path in INFERENCE_ROUTES else None
        is_models = path == "/v1/models" or path.startswith("/v1/models/")
        label = route or ("/v1/models" if is_models else "other")
        try:
            if route is not None:
                if method not in ("POST", "PUT") or (method == "PUT" and route != GENERATE):
                    allow = b"POST, PUT" if route == GENERATE else b"POST"
                    raise MethodNotAllowed(
                        f"{method} is not allowed on {path}", headers=((b"allow", allow),)
                    )
                await self._inference(scope, receive, send, route)
                return
            if label == "/v1/models":
                if method != "GET":
                    raise MethodNotAllowed(
                        f"{method} is not allowed on {path}", headers=((b"allow", b"GET"),)
                    )
                await self._models(path, send)
                self.metrics.requests.labels(label, "200").inc()
                return
            raise RouteNotFound(f"no route for {method} {path}")
        except EdgeError as err:
            await render_error(send, err)
            self.metrics.requests.labels(label, str(err.status)).inc()

    # -- /v1/models --------------------------------------------------------------------------

    async def _models(self, path: str, send: Send) -> None:
        listing = await self.catalog.listing()
        if path == "/v1/models":
            await send_json(send, 200, listing)
            return
        model = path[len("/v1/models/") :]
        card = self.catalog.card(model)
        if card is None:
            raise ModelNotFound(f"The model `{model}` does not exist.", param="model")
        await send_json(send, 200, card)

    # -- inference ---------------------------------------------------------------------------

    async def _inference(self, scope: Scope, receive: Receive, send: Send, route: str) -> None:
        ext = scope.get("extensions") or {}
        transport = ext.get("transport") or _TRANSPORT_BY_VERSION.get(
            scope.get("http_version", "1.1"), "h1"
        )
        early = bool(ext.get("early_data", False))
        wait = float(ext.get("handshake_wait_s", 0.0) or 0.0)
        # From the socket read that completed the head where the listener says (the time in
        # its parser and the loop's queue is the edge's too); a deferred 0-RTT request starts
        # when the handshake released it, its wait is counted apart.
        arrived = ext.get("arrived_at")
        t0 = arrived + wait if arrived else time.perf_counter()
        headers = read_headers(scope["headers"])
        trace: RequestTrace | None = None
        request_id = "-"
        ex: Exchange | None = None
        try:
            request_id = request_id_from(headers.request_id)
            tenant = self.admission.identify(headers.authorization)
            if self.tracer is not None:  # decided once: no tracer, no span objects
                trace = RequestTrace(
                    self.tracer,
                    start=t0 - wait,
                    traceparent=headers.traceparent,
                    tracestate=headers.tracestate,
                    attributes={
                        "http.route": route,
                        "quicedge.transport": transport,
                        "quicedge.early_data": early,
                        "quicedge.request_id": request_id,
                        "quicedge.tenant": tenant.name,
                        "quicedge.tier": tenant.tier,
                        "quicedge.policy": self.policy.name,
                    },
                )
                if wait > 0:
                    trace.stage("handshake_wait", t0 - wait, t0)
            ex = Exchange(
                route=route, t0=t0, transport=transport, early_data=early,
                handshake_wait=wait, request_id=request_id, headers=headers, trace=trace,
                body_writer=ext.get("quicedge.body_writer"),
                on_disconnect=ext.get("quicedge.on_disconnect"),
                tenant=tenant.name, tier=tenant.tier, tier_rank=tenant.rank,
            )  # fmt: skip
            if wait > 0:
                self.metrics.handshake_wait.observe(wait)
            await self._parse_and_admit(ex, receive, tenant)
            try:
                await self._forward(ex, receive, send)
            finally:
                reported = ex.usage.completion_tokens if ex.usage is not None else None
                self.admission.finish(ex, ex.content_chunks if reported is None else reported)
        except EdgeError as err:
            if trace is not None:
                trace.set("http.status_code", err.status)
                trace.end(time.perf_counter(), error=err.message)
            if ex is not None and ex.started:  # too late for an error page; the stream ended
                log.warning(
                    "request %s (tenant %s) failed after the response started: %s",
                    request_id, ex.tenant, err,
                )  # fmt: skip
                self.metrics.requests.labels(route, str(ex.status)).inc()
                return
            err.extra_headers = (*err.extra_headers, (b"x-request-id", request_id.encode()))
            raise
        except ClientGone:
            self.metrics.disconnects.inc()
            self.metrics.requests.labels(route, "499").inc()
            if trace is not None:
                trace.end(time.perf_counter(), error="client disconnected")
            return
        assert ex is not None
        status = ex.status
        self.metrics.requests.labels(route, str(status)).inc()
        if trace is not None:
            trace.set("http.status_code", status)
            trace.set("quicedge.retries", ex.retries)
            trace.end(time.perf_counter(), error="client disconnected" if ex.disconnected else None)

    async def _parse_and_admit(self, ex: Exchange, receive: Receive, tenant: Tenant) -> None:
        """Parse (body, JSON once) then admit (fields, model, routing view, tenant quota)."""
        h = ex.headers
        check_content_type(h.content_type)
        limit = self.config.max_body_bytes
        declared_length(h.content_length, limit)
        raw = await read_body(receive, limit)
        body = parse_json_object(raw)
        t_parsed = time.perf_counter()
        ex.stream = validate(ex.route, body)
        if ex.route != GENERATE:
            await self.catalog.check(body.get("model"))
        session = h.session.decode("latin-1") if h.session else None
        ex.view = build_view(ex.route, body, session)
        rid = body.get("rid")
        ex.abort_rid = rid if isinstance(rid, str) else (ex.request_id if rid is None else None)
        ex.payload = splice_rid(raw, body, ex.request_id)
        traceparent, tracestate = h.traceparent, h.tracestate
        if ex.trace is not None:
            traceparent, tracestate = ex.trace.upstream_context()
        ex.upstream_headers = upstream_headers(
            request_id=ex.request_id,
            early_data=ex.early_data,
            traceparent=traceparent,
            tracestate=tracestate,
        )
        await self.admission.admit(ex, tenant)  # last: nothing after it may fail and leak a slot
        t_admitted = time.perf_counter()
        self.metrics.stage_parse.observe(t_parsed - ex.t0)
        self.metrics.stage_admit.observe(t_admitted - t_parsed)
        if ex.trace is not None:
            ex.trace.stage("parse", ex.t0, t_parsed)
            ex.trace.stage("admit", t_parsed, t_admitted)
            ex.trace.set("quicedge.stream", ex.stream)
            ex.trace.set("quicedge.approx_prompt_tokens", ex.view.approx_tokens)

    async def _forward(self, ex: Exchange, receive: Receive, send: Send) -> None:
        """Route and try backends in turn; all of it is cancelled if the client goes away (the
        listener's callback says so, or a task watching for `http.disconnect`)."""
        task = asyncio.current_task()
        assert task is not None
        watcher: asyncio.Task[None] | None = None
        if ex.on_disconnect is not None:
            ex.on_disconnect(lambda: _client_gone(task, ex))
        else:
            watcher = task.get_loop().create_task(_watch_disconnect(receive, task, ex))
        try:
            await self._attempts(ex, send)
        except asyncio.CancelledError:
            if not ex.disconnected:
                raise
            task.uncancel()
            self.metrics.disconnects.inc()
            ex.status = ex.status or 499  # nginx's "client closed request"
        finally:
            if watcher is not None:
                watcher.cancel()
            elif ex.on_disconnect is not None:
                ex.on_disconnect(None)

    async def _attempts(self, ex: Exchange, send: Send) -> None:
        tried: list[Backend] = []
        last: _Retry | None = None
        assert ex.view is not None
        for attempt in range(self.config.max_retries + 1):
            candidates = await self.admission.place(
                ex, lambda: [b for b in self.registry.candidates() if b not in tried]
            )
            if not candidates:
                if last is not None:
                    raise last.error
                raise self._no_candidate()
            t_route = time.perf_counter()
            decision = self.policy.choose(ex.view, candidates)
            t_routed = time.perf_counter()
            backend = decision.backend
            tried.append(backend)
            self.metrics.stage_route.observe(t_routed - t_route)
            self.metrics.decisions.labels(self.policy.name, decision.reason).inc()
            if ex.trace is not None:
                ex.trace.stage(
                    "route", t_route, t_routed,
                    {"quicedge.backend": backend.name, "quicedge.reason": decision.reason,
                     "quicedge.predicted_cached_tokens": decision.predicted_cached_tokens},
                )  # fmt: skip
            prefill = ex.view.approx_tokens - decision.predicted_cached_tokens
            # the last try relays whatever the backend answers: no other backend is left to ask
            last_try = attempt == self.config.max_retries or len(candidates) == 1
            try:
                with self.registry.track(backend, prefill_tokens=prefill) as ticket:
                    await self._attempt(ex, backend, decision, ticket, send, last_try=last_try)
                return
            except _Retry as retry:
                last = retry
                ex.retries += 1
                self.metrics.retries.labels(retry.reason).inc()
        assert last is not None
        raise last.error

    async def _attempt(
        self,
        ex: Exchange,
        backend: Backend,
        decision: Decision,
        ticket: Ticket,
        send: Send,
        *,
        last_try: bool,
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
            relay = _stream_relay(ex, ticket)
            on_head = partial(self._begin_relay, ex, backend, relay)
        t_send = time.perf_counter()
        try:
            try:
                response = await self.pool.request(
                    backend.url, "POST", ex.route,
                    headers=ex.upstream_headers, body=ex.payload,
                    first_byte_timeout=self.config.first_byte_timeout,
                    chunk_timeout=self.config.chunk_timeout, on_head=on_head,
                )  # fmt: skip
            except UpstreamError as exc:
                error = exc.kind
                self._upstream_failed(backend, exc.kind)
                if isinstance(exc, UpstreamTimeout | UpstreamProtocolError):
                    self._abort(ex, backend)  # it may have reached the backend
                if isinstance(exc, UpstreamConnectError | UpstreamProtocolError) and not last_try:
                    raise _Retry(from_upstream(exc), exc.kind) from None
                raise from_upstream(exc) from None
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
            if status in RETRY_STATUSES and not last_try:
                with contextlib.suppress(UpstreamError):
                    await response.read()  # small error body: keeps the connection reusable
                error = "429" if status == 429 else "5xx"
                self._upstream_failed(backend, error)
                raise _Retry(_retry_error(backend, status), reason=str(status)) from None
            if ex.stream and status == 200:
                result = await self._relay(ex, response, backend, ticket, send, t_head, relay)
                usage, completion = result.usage, result.text
                error = self._stream_error(result)
                if result.first_upstream is not None:
                    upstream_ttft = result.first_upstream - t_send
                account_stream(self.metrics, ex, backend, result, t_send, upstream_ttft)
                ex.content_chunks = len(result.gaps) + (result.first_client is not None)
            else:
                try:
                    body = await read_whole(response, MAX_UPSTREAM_BODY)
                except UpstreamError as exc:
                    error = exc.kind
                    self._upstream_failed(backend, exc.kind)
                    raise from_upstream(exc) from None
                ex.started = True
                out = response_headers(
                    response.headers, request_id=ex.request_id, backend_name=backend.name
                )
                out.append((b"content-length", b"%d" % len(body)))
                await send({"type": "http.response.start", "status": status, "headers": out})
                ex.responded = True
                await send({"type": "http.response.body", "body": body, "more_body": False})
                ex.status = status
                if status == 200:
                    usage, completion = answer_of_body(body)
                    error = None
                else:
                    error = "5xx" if status >= 500 else ("429" if status == 429 else "4xx")
                    if status >= 500:
                        self._upstream_failed(backend, error)
            if error is None:
                self.registry.record_success(backend, ttft_s=upstream_ttft)
            elif error == "4xx":
                self.registry.record_failure(backend, "4xx")
            account_cache(self.metrics, ex, decision, usage)
        except asyncio.CancelledError:
            if ex.disconnected:
                error = "disconnect"
                self.registry.record_failure(backend, "disconnect")
                self._abort(ex, backend)
            raise
        finally:
            if response is not None and not response.complete:
                await response.aclose()  # aborts the upstream request (its connection closes)
            self.policy.observe(
                Outcome(
                    backend=backend, view=ex.view, decision=decision, ttft_s=upstream_ttft,
                    prompt_tokens=usage.prompt_tokens, cached_tokens=usage.cached_tokens,
                    completion_text=completion, error=error,
                )
            )  # fmt: skip

    async def _relay(
        self,
        ex: Exchange,
        response: UpstreamResponse,
        backend: Backend,
        ticket: Ticket,
        send: Send,
        t_head: float,
        relay: StreamRelay | None,
    ) -> RelayResult:
        if relay is None:
            relay = _stream_relay(ex, ticket)
        ex.started = True
        ex.status = 200
        await relay.run(response, send, _start_of(ex, response, backend))
        result = relay.result
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

    @staticmethod
    def _begin_relay(
        ex: Exchange, backend: Backend, relay: StreamRelay, response: UpstreamResponse
    ) -> None:
        """`on_head`: a streamed 200 starts at once (anything else waits for the task, which
        may retry it elsewhere)."""
        if response.status == 200:
            ex.started = True
            ex.status = 200
            relay.begin(response, _start_of(ex, response, backend))

    @staticmethod
    def _stream_error(result: RelayResult) -> str | None:
        if result.upstream_error is not None:
            return result.upstream_error.kind
        if result.backend_error is not None:
            return "backend_error"
        return None

    def _no_candidate(self) -> EdgeError:
        """503, saying whether the fleet is down or only full (every backend at its cap)."""
        healthy = [b for b in self.registry.backends if b.healthy]
        if healthy and all(
            b.max_concurrency is not None and b.in_flight >= b.max_concurrency for b in healthy
        ):
            return NoHealthyBackend(
                "every backend is at its concurrency cap; retry shortly", code="at_capacity"
            )
        return NoHealthyBackend("no healthy backend can take the request now")

    def _upstream_failed(self, backend: Backend, kind: str) -> None:
        self.metrics.upstream_errors.labels(backend.name, kind).inc()
        self.registry.record_failure(backend, kind)

    def _abort(self, ex: Exchange, backend: Backend) -> None:
        if ex.abort_rid is not None:
            self.abort(backend, ex.abort_rid)


async def _watch_disconnect(receive: Receive, task: asyncio.Task[Any], ex: Exchange) -> None:
    """Wait for `http.disconnect` after the body was read; then cancel the request's task."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            _client_gone(task, ex)
            return


def _client_gone(task: asyncio.Task[Any], ex: Exchange) -> None:
    """Cancel the request, unless its response was already handed over (then it is its end)."""
    if not ex.responded:
        ex.disconnected = True
        task.cancel()


def _stream_relay(ex: Exchange, ticket: Ticket) -> StreamRelay:
    return StreamRelay(
        RelayResult(), route=ex.route, writer=ex.body_writer,
        on_first_token=ticket.first_token, on_complete=ex.mark_responded,
    )  # fmt: skip


def _start_of(
    ex: Exchange, response: UpstreamResponse, backend: Backend
) -> MutableMapping[str, Any]:
    """The client's `http.response.start` for a relayed 200."""
    return {
        "type": "http.response.start",
        "status": 200,
        "headers": response_headers(
            response.headers, request_id=ex.request_id, backend_name=backend.name
        ),
    }


def _retry_error(backend: Backend, status: int) -> EdgeError:
    message = f"backend {backend.name} answered {status}"
    if status == 429:
        return TooManyRequests(message)
    if status == 503:
        return NoHealthyBackend(message)
    return BadGateway(message)
