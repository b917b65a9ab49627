"""The proxy's ASGI app: one request through parse → admit → route → forward → relay → account.

Each stage is a plain function (`edge.stages`, `edge.routing`, `edge.relay`); this module runs
parse and admit in order and times them, hands the request to `edge.attempt.Attempts` (route,
forward, relay, account; another backend while nothing has reached the client), cancels it when
the client goes away, and renders every `EdgeError` in one place (`edge.asgi.render_error`). It
runs unchanged under the H3 server, under hypercorn (H1/H2) and in-process in tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import parse_qs

from backends.credentials import BackendCredentials
from backends.pool import UpstreamPool
from backends.registry import BackendRegistry
from edge.access_log import AccessLog
from edge.admission import Admission, AdmissionSettings
from edge.admission.tenants import Tenant
from edge.asgi import Receive, Scope, Send, body_writer, lifespan, render_error, send_json
from edge.attempt import Aborter, Attempts
from edge.audit import AuditLog
from edge.config import ProxyConfig
from edge.errors import (
    EdgeError,
    InternalError,
    InvalidRequest,
    LoopDetected,
    MethodNotAllowed,
    ModelNotFound,
    RouteNotFound,
    StateUnavailable,
    Unauthorized,
)
from edge.exchange import Exchange, RequestHeaders, read_headers
from edge.models import DEFAULT_MODEL, ModelCatalog, Models
from edge.policy.gateway import PolicyGateway
from edge.routing.base import RoutingPolicy
from edge.routing.breakers import Breakers
from edge.stages.body import (
    BodyBudget,
    ClientGone,
    check_content_type,
    declared_length,
    parse_json_object,
    read_body,
)
from edge.stages.forward import (
    USAGE_ROUTES,
    ask_usage,
    label_from_body,
    new_request_id,
    request_id_from,
    splice_rid,
    upstream_headers,
    upstream_rid,
    whole_payload,
)
from edge.stages.validate import (
    CHAT,
    COMPLETIONS,
    DETOKENIZE,
    EMBEDDINGS,
    GENERATE,
    RERANK,
    TOKENIZE,
    WHOLE_ROUTES,
    validate,
)
from edge.stages.view import build_view
from edge.state.background import POLL_S, RUNNING, Broadcast, follow
from edge.state.responses import RESPONSES
from edge.state.stage import StateStage
from edge.telemetry import Metrics
from edge.tracing import (
    RequestTrace,
    Tracer,
    forwarded_context,
    genai_request_attributes,
    server_attributes,
)

log = logging.getLogger(__name__)

ROUTE_METHODS: dict[str, tuple[str, ...]] = {
    CHAT: ("POST",),
    COMPLETIONS: ("POST",),
    GENERATE: ("POST", "PUT"),
    EMBEDDINGS: ("POST",),
    RERANK: ("POST",),
    TOKENIZE: ("POST",),
    DETOKENIZE: ("POST",),
    RESPONSES: ("POST",),
}
"""The routes forwarded to a backend and the methods each takes (SGLang's: /generate takes PUT)."""
INFERENCE_ROUTES = tuple(ROUTE_METHODS)
MODELS_METHODS = ("GET",)


STORED_ROUTES: tuple[tuple[re.Pattern[str], str, tuple[str, ...]], ...] = tuple(
    (re.compile(pattern.replace("{id}", "([^/]+)").replace("{item}", "([^/]+)") + "()?()?"),
     pattern, methods)
    for pattern, methods in (
        (RESPONSES + "/{id}", ("GET", "DELETE")),
        (RESPONSES + "/{id}/input_items", ("GET",)),
        (RESPONSES + "/{id}/cancel", ("POST",)),
        ("/v1/conversations", ("POST",)),
        ("/v1/conversations/{id}", ("GET", "POST", "DELETE")),
        ("/v1/conversations/{id}/items", ("GET", "POST")),
        ("/v1/conversations/{id}/items/{item}", ("GET", "DELETE")),
        (CHAT + "/{id}", ("GET", "POST", "DELETE")),
        (CHAT + "/{id}/messages", ("GET",)),
    )
)  # fmt: skip
"""Stored responses and conversations by id (`edge.state.stored`): (path, route label,
methods). Answered by the edge, never forwarded."""


UNSERVED_ROUTES = frozenset({RESPONSES + "/input_tokens", RESPONSES + "/compact"})
"""OpenAI's own routes under `/v1/responses/` (SDK methods of their own) that the edge does
not serve: unknown routes (404), not a response's id (which took them for 405s)."""


def stored_route(path: str) -> tuple[str, tuple[str, ...], str, str] | None:
    """(the route's label, its methods, the id in the path, the item id in it) for a stored
    object's path."""
    if path in UNSERVED_ROUTES:
        return None
    for pattern, label, methods in STORED_ROUTES:
        match = pattern.fullmatch(path)
        if match is not None:
            return label, methods, match.group(1) or "", match.group(2) or ""
    return None


def allowed_methods(path: str) -> tuple[str, ...] | None:
    """The methods the proxy answers on `path`; None for a path it does not serve."""
    methods = ROUTE_METHODS.get(path)
    if methods is None and (path == "/v1/models" or path.startswith("/v1/models/")):
        return MODELS_METHODS
    if methods is None and (stored := stored_route(path)) is not None:
        return stored[1]
    return methods


_TRANSPORT_BY_VERSION = {"3": "h3", "2": "h2", "2.0": "h2"}

MAX_EDGE_HOPS = 8
"""Edges a request may have passed (its `Via` names them) before the next refuses it."""


class Via:
    """This edge's `Via` entry (RFC 9110 §7.6.3), added to every request it forwards after the
    ones the request came with, and the check that cuts a loop: a request whose `Via` names
    this edge has come back to it (a backend that is the edge itself, found by discovery or
    given by hand, or one that leads back to it) and is refused with 508 `loop_detected`,
    rather than sent around until the upstream pool is exhausted. The name is random per app,
    so each worker of a serve has its own; `MAX_EDGE_HOPS` cuts a loop through more edges than
    that, each of which would see the request only once."""

    def __init__(self) -> None:
        self.name = b"quicedge-" + os.urandom(6).hex().encode()
        self.headers = {t: (b"via", b"%s %s" % (v, self.name)) for t, v in _VIA_VERSIONS.items()}
        """The header of a request that came with no `Via`, by transport: made once."""
        self.h1 = self.headers["h1"]

    def check(self, via: bytes) -> None:
        """Refuse a request that has passed this edge, or `MAX_EDGE_HOPS` edges."""
        if self.name in via:
            raise LoopDetected(
                "loop detected: this request came back to the edge that forwarded it (its "
                "Via header names it): a backend of that edge is the edge itself or leads back "
                "to it; check --backend, [proxy] backends and the [discovery] names"
            )
        if via.count(b" quicedge-") >= MAX_EDGE_HOPS:
            raise LoopDetected(
                f"loop detected: this request has passed {MAX_EDGE_HOPS} edges already (its Via "
                "header names them): the edges' backends lead from one to the next in a loop"
            )

    def after(self, via: bytes, transport: str) -> tuple[bytes, bytes]:
        """The `Via` header to send upstream for a request that came with `via`: its entries,
        then this edge's."""
        return (b"via", via + b", " + self.headers.get(transport, self.h1)[1])


_VIA_VERSIONS = {"h1": b"1.1", "h2": b"2", "h3": b"3"}
"""The protocol version a `Via` entry names, by the transport that carried the request."""


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
        state: StateStage | None = None,
        admission: Admission | None = None,
        gateway: PolicyGateway | None = None,
        audit: AuditLog | None = None,
        breakers: Breakers | None = None,
        credentials: BackendCredentials | None = None,
        access_log: AccessLog | None = None,
        models: Models | None = None,
    ) -> None:
        self.access_log = access_log
        self.config = config
        self.gateway = gateway
        self.audit = audit
        self.pool = pool
        self.registry = registry
        self.metrics = metrics
        self.catalog = catalog
        self.abort = abort
        self.tracer = tracer
        self.models = models
        self.state = state
        self.via = Via()
        self._background: set[asyncio.Task[None]] = set()
        """Background responses being generated (`_in_background`)."""
        limit = config.max_pending_body_bytes
        self.body_budget = budget = BodyBudget(limit) if limit else None
        if budget is not None:
            metrics.pending_body_bytes.set_function(lambda: budget.held)
            metrics.pending_body_bytes_limit.set(limit)
        answers = config.max_pending_answer_bytes
        self.answer_budget = held = BodyBudget(answers, "non-streamed answers") if answers else None
        if held is not None:
            metrics.pending_answer_bytes.set_function(lambda: held.held)
            metrics.pending_answer_bytes_limit.set(answers)
        self.admission = admission or Admission(AdmissionSettings(), metrics=metrics)
        self.attempts = Attempts(
            config=config, pool=pool, registry=registry, policy=policy, metrics=metrics,
            abort=abort, admission=self.admission, gateway=gateway, breakers=breakers,
            credentials=credentials, models=models, answer_budget=held,
        )  # fmt: skip

    def set_gateway(self, gateway: PolicyGateway | None) -> None:
        """A reloaded `[policy]`'s gateway, for the requests that start next (those in progress
        keep the one they started with)."""
        self.gateway = self.attempts.gateway = gateway

    @property
    def policy(self) -> RoutingPolicy:
        """The routing policy (the one `attempts` asks; setting it swaps it there)."""
        return self.attempts.policy

    @policy.setter
    def policy(self, policy: RoutingPolicy) -> None:
        self.attempts.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            await lifespan(receive, send)
            return
        if kind != "http":
            return
        path: str = scope["path"]
        method: str = scope["method"]
        methods = ROUTE_METHODS.get(path)
        route = path if methods is not None else None
        if route == CHAT and method == "GET":  # the stored completions' list
            route = methods = None
        is_models = path == "/v1/models" or path.startswith("/v1/models/")
        stored = stored_route(path) if route is None and not is_models else None
        if stored is None and path == CHAT:
            stored = (CHAT, ("GET", "POST"), "", "")
        label = route or ("/v1/models" if is_models else stored[0] if stored else "other")
        tracked: _Tracked | None = None
        rid = "-"  # the answer's x-request-id; an inference route's own sets its own
        try:
            if route is not None and methods is not None:
                if method not in methods:
                    allow = ", ".join(methods).encode()
                    raise MethodNotAllowed(
                        f"{method} is not allowed on {path}", headers=((b"allow", allow),)
                    )
                await self._inference(scope, receive, send, route)
                return
            rid = _answer_id(scope["headers"])
            if label == "/v1/models":
                if method not in ("GET", "HEAD"):  # HEAD: GET without the body (RFC 9110)
                    raise MethodNotAllowed(
                        f"{method} is not allowed on {path}", headers=((b"allow", b"GET, HEAD"),)
                    )
                self._authenticate(scope)
                await self._models(path, send if method == "GET" else _head_only(send), rid)
                self.metrics.requests.labels(label, "200", NO_MODEL).inc()
                if self.access_log is not None:
                    self._log_other(scope, label, 200, rid)
                return
            if stored is not None:
                if method not in stored[1]:
                    raise MethodNotAllowed(
                        f"{method} is not allowed on {path}",
                        headers=((b"allow", ", ".join(stored[1]).encode()),),
                    )
                tracked = _Tracked(send)
                await self._stored(scope, receive, tracked, stored, rid)
                self.metrics.requests.labels(label, "200", NO_MODEL).inc()
                if self.access_log is not None:
                    self._log_other(scope, label, 200, rid)
                return
            raise RouteNotFound(f"no route for {method} {path}")
        except ClientGone:  # left while sending a body: nothing to answer, no fault of ours
            if rid == "-":
                rid = _answer_id(scope["headers"])
            self.metrics.requests.labels(label, "499", NO_MODEL).inc()
            if self.access_log is not None:
                self._log_other(scope, label, 499, rid, "client disconnected")
        except Exception as exc:
            if rid == "-":
                rid = _answer_id(scope["headers"])
            err = exc if isinstance(exc, EdgeError) else _internal(scope, rid)
            if tracked is not None and tracked.status:  # too late for an error answer
                # %r: the path is the client's, percent-decoded (a %0A would start a line)
                log.warning("%s %r failed after its response started: %s", method, path, err)
                with contextlib.suppress(Exception):  # the body ends, whole, where it was
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                self.metrics.requests.labels(label, str(tracked.status), NO_MODEL).inc()
                if self.access_log is not None:
                    self._log_other(scope, label, tracked.status, rid, err.message)
                return
            err.extra_headers = (*err.extra_headers, (b"x-request-id", rid.encode()))
            await render_error(send, err, body_writer(scope))
            self.metrics.requests.labels(label, str(err.status), NO_MODEL).inc()
            if self.access_log is not None:
                self._log_other(scope, label, err.status, rid, err.message)

    def _log(
        self,
        ex: Exchange | None,
        scope: Scope,
        route: str,
        status: int,
        t0: float,
        error: str | None = None,
        request_id: str | None = None,
    ) -> None:
        if self.access_log is not None:
            self.access_log.request(
                ex, route=route, method=scope["method"], status=status,
                t_end=time.perf_counter(), t0=t0, error=error, request_id=request_id,
            )  # fmt: skip

    def _log_other(
        self, scope: Scope, label: str, status: int, rid: str, error: str | None = None
    ) -> None:
        """A request outside the inference routes (models, unknown paths, wrong methods)."""
        assert self.access_log is not None
        arrived = (scope.get("extensions") or {}).get("arrived_at")
        now = time.perf_counter()
        self.access_log.request(
            None, route=label, method=scope["method"], status=status, t_end=now,
            t0=arrived or now, error=error, request_id=rid,
        )  # fmt: skip

    def _model_label(self, model: object) -> str:
        """The `model` label: a model the fleet serves (or `default`, which every backend
        answers to), else `other`; a body without one is `default` (SGLang's)."""
        if model is None or model == DEFAULT_MODEL:
            return DEFAULT_MODEL
        known = self.catalog.known
        return model if known is not None and model in known else OTHER_MODEL

    def _served_model(self, ex: Exchange) -> str | None:
        """The model that answered, as the backend names it: the one asked for, or the fleet's
        only model behind `default`."""
        if ex.model not in (DEFAULT_MODEL, OTHER_MODEL):
            return ex.model
        known = self.catalog.known
        return next(iter(known)) if known is not None and len(known) == 1 else None

    # -- /v1/models --------------------------------------------------------------------------

    def _authenticate(self, scope: Scope) -> None:
        """The caller's key checked as on every route (401 for a key the edge does not know,
        or for none while the anonymous tenant is off): SDKs and the tools built on them check
        a key with the model list. Nothing is charged."""
        try:
            self.admission.directory.identify(read_headers(scope["headers"]).authorization)
        except Unauthorized:
            self.metrics.admission_rejections.labels("-", "unauthorized").inc()
            raise

    async def _models(self, path: str, send: Send, rid: str) -> None:
        if self.models is not None:
            listing = await self.models.pools.listing()
        else:
            listing = await self.catalog.listing()
        extra = ((b"x-request-id", rid.encode()),)
        if path == "/v1/models":
            await send_json(send, 200, listing, extra)
            return
        model = path[len("/v1/models/") :]
        card = next((c for c in listing["data"] if c["id"] == model), None)
        if card is None and model == DEFAULT_MODEL:
            card = _default_card(listing)
        if card is None:
            raise ModelNotFound(f"The model `{model}` does not exist.", param="model")
        await send_json(send, 200, card, extra)

    # -- stored responses and conversations --------------------------------------------------

    async def _stored(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        route: tuple[str, tuple[str, ...], str, str],
        rid: str,
    ) -> None:
        """Read back, change, delete or start what `edge.state` stores for the caller's tenant;
        another tenant's id is not found, as an unknown one."""
        label, _, name, item = route
        headers = read_headers(scope["headers"])
        caller = self.admission.identify(headers.authorization)
        if self.state is None:
            raise RouteNotFound(f"no route for {scope['method']} {scope['path']}")
        ratelimit = await self.admission.charge_call(caller)
        tenant = caller.name
        stored, query = self.state.stored, scope.get("query_string", b"")
        if label == RESPONSES + "/{id}" and scope["method"] == "GET" and _wants_stream(query):
            await self._resume(send, receive, tenant, name, query, ratelimit, rid)
            return
        if label.startswith(CHAT):
            answer = await self._stored_completions(scope, receive, label, tenant, name, query)
        elif label == RESPONSES + "/{id}/cancel":  # no body to read
            answer = await stored.cancel(tenant, name)
            self._audit_stored("response.cancel", tenant, name)
        elif scope["method"] == "POST":
            body = await self._stored_body(headers, receive)
            if label == "/v1/conversations":
                answer = await stored.create(tenant, body)
                self._audit_stored("conversation.create", tenant, answer["id"])
            elif label == "/v1/conversations/{id}":
                answer = await stored.set_metadata(tenant, name, body)
                self._audit_stored("conversation.update", tenant, name)
            else:
                answer = await stored.add_items(tenant, name, body)
                self._audit_stored("conversation.items_add", tenant, name)
        elif scope["method"] == "DELETE" and item:
            answer = await stored.remove_item(tenant, name, item)
            self._audit_stored("conversation.items_delete", tenant, name)
        elif scope["method"] == "DELETE":
            response = label.startswith(RESPONSES)
            answer = await stored.delete(tenant, name, response=response)
            if response and self.state.events is not None:  # its stream goes with it
                with contextlib.suppress(StateUnavailable):  # deleted: not a 503 for that
                    await self.state.events.clear(tenant, name)
            self._audit_stored(f"{'response' if response else 'conversation'}.delete", tenant, name)
        elif label == RESPONSES + "/{id}":
            answer = await stored.response(tenant, name)
        elif label == RESPONSES + "/{id}/input_items":
            answer = await stored.input_items(tenant, name, query)
        elif label == "/v1/conversations/{id}":
            answer = await stored.conversation(tenant, name)
        elif label == "/v1/conversations/{id}/items":
            answer = await stored.conversation_items(tenant, name, query)
        else:
            answer = await stored.conversation_item(tenant, name, item)
        if answer is not None:  # None: the client left while it sent the body
            await send_json(send, 200, answer, [(b"x-request-id", rid.encode()), *ratelimit])

    async def _stored_body(self, headers: RequestHeaders, receive: Receive) -> dict[str, Any]:
        """A stored object's POST body, checked as an inference body is (`ClientGone`: the
        client left while sending it, counted 499 by `__call__`)."""
        check_content_type(headers.content_type, headers.content_encoding)
        limit = self.config.max_body_bytes
        declared_length(headers.content_length, limit)
        return parse_json_object(await read_body(receive, limit, self.body_budget))

    async def _resume(
        self,
        send: Send,
        receive: Receive,
        tenant: str,
        rid: str,
        query: bytes,
        ratelimit: list[tuple[bytes, bytes]],
        request_id: str,
    ) -> None:
        """`GET /v1/responses/{id}?stream=true&starting_after=N`: a background stream's events
        after N, then the rest as they come, from whichever edge generates it."""
        assert self.state is not None
        events = self.state.events
        args = parse_qs(query.decode("latin-1"))
        try:
            after = int(args.get("starting_after", ["-1"])[-1])
        except ValueError:
            after = -2
        if after < -1:
            raise InvalidRequest("'starting_after' must be an integer >= -1",
                                 param="starting_after")  # fmt: skip
        await self.state.stored.response(tenant, rid)  # 404 for what is not there
        if events is None or await events.read(tenant, rid, 0) is None:
            raise InvalidRequest(
                "this response keeps no event stream to resume: only a background response "
                "asked with stream: true does", param="stream", code="not_resumable",
            )  # fmt: skip
        within = self.state.config.conversations.background_max  # the longest run
        records = self.state.records

        async def ended() -> bool:
            """The response is no longer running: its record (one cheap read) says it ended,
            or is gone (stored, deleted). Unknown while the store does not answer."""
            if records is None:
                return False
            try:
                record = await records.get(tenant, rid)
            except StateUnavailable:
                return False
            return record is None or record.as_read().status != RUNNING

        await _stream_events(send, receive, follow(events, tenant, rid, after + 1,
                                                   within=within, ended=ended), request_id,
                             ratelimit)  # fmt: skip

    async def _stored_completions(
        self, scope: Scope, receive: Receive, label: str, tenant: str, name: str, query: bytes
    ) -> dict[str, Any] | None:
        """The stored chat completions' routes (`edge.state.completions`)."""
        assert self.state is not None
        completions = self.state.completions
        if completions is None:
            raise InvalidRequest(
                "stored chat completions are turned off on this edge (they are kept where "
                "conversations are)", code="conversations_disabled",
            )  # fmt: skip
        method = scope["method"]
        if label == CHAT:
            return await completions.listing(tenant, query)
        if label == CHAT + "/{id}/messages":
            return await completions.messages(tenant, name, query)
        if method == "DELETE":
            answer = await completions.delete(tenant, name)
            self._audit_stored("chat_completion.delete", tenant, name)
            return answer
        if method == "POST":
            body = await self._stored_body(read_headers(scope["headers"]), receive)
            answer = await completions.update(tenant, name, body)
            self._audit_stored("chat_completion.update", tenant, name)
            return answer
        return await completions.retrieve(tenant, name)

    def _audit_stored(self, action: str, tenant: str, name: str) -> None:
        """A stored conversation created, changed or deleted: a line of the audit chain (reads
        are not; they change nothing)."""
        if self.audit is not None:
            self.audit.record_event("stored", action=action, tenant=tenant, id=name)

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
            if headers.via is not None:  # forwarded by an edge (perhaps this one)
                self.via.check(headers.via)
            tenant = self.admission.identify(headers.authorization)
            if self.tracer is not None:  # decided once: no tracer, no span objects
                trace = RequestTrace(
                    self.tracer,
                    start=t0 - wait,
                    traceparent=headers.traceparent,
                    tracestate=headers.tracestate,
                    attributes={
                        **server_attributes(scope, route, transport),
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
            try:
                await self._parse_and_admit(ex, receive, tenant)
                if ex.state is not None and ex.state.background:
                    await self._detach(ex, scope, receive, send)
                    return
                try:
                    relay_send: Send | None = send
                    if ex.state is not None:  # a hit's whole answer meets the stream rules
                        gateway = self.gateway
                        whole = gateway.whole if gateway is not None else None
                        relay_send = await ex.state.begin(send, whole)
                        if relay_send is None and self.models is not None:
                            self.models.unsample(ex)  # no stable reply: nothing to mirror
                    if relay_send is not None:  # None: answered from the response cache
                        await self._forward(ex, receive, relay_send)
                    elif ex.state is not None and ex.state.replay_cut is not None:
                        if self.gateway is not None:  # as a live stream's cut is
                            self.gateway.filtered(ex, ex.state.replay_cut)
                finally:
                    self._finish_admission(ex)
            finally:
                if ex.state is not None and not ex.state.detached:
                    await ex.state.finish()
        except ClientGone:
            if self.audit is not None and ex is not None:
                self.audit.record_exchange(ex, 499)
            self.metrics.disconnects.inc()
            self.metrics.requests.labels(route, "499", ex.model if ex else NO_MODEL).inc()
            if trace is not None:
                trace.end(time.perf_counter(), error="client disconnected")
            self._log(ex, scope, route, 499, t0, "client disconnected")
            return
        except asyncio.CancelledError:  # the listener cancelled it (a stop past its drain)
            if trace is not None:
                trace.end(time.perf_counter(), error="request cancelled (the edge stopping)")
            raise
        except Exception as exc:
            if ex is not None:
                request_id = ex.request_id  # the label, which the body may have given
            if isinstance(exc, EdgeError):
                # `err` outlives the block: its traceback would hold the frames of the request
                # (its body's chunks among them) in a cycle until the collector runs.
                err = exc.with_traceback(None)
            else:
                err = _internal(scope, request_id)
            model = ex.model if ex is not None else NO_MODEL
            if self.audit is not None and ex is not None:
                self.audit.record_exchange(ex, ex.status if ex.started else err.status)
            if trace is not None:
                trace.set("http.response.status_code", err.status)
                trace.set("error.type", str(err.status) if err.status >= 500 else None)
                trace.end(time.perf_counter(), error=err.message)
            if ex is not None and ex.started:  # too late for an error page; the stream ended
                log.warning(
                    "request %s (tenant %s) failed after the response started: %s",
                    request_id, ex.tenant, err,
                )  # fmt: skip
                self.metrics.requests.labels(route, str(ex.status), model).inc()
                self._log(ex, scope, route, ex.status, t0, err.message)
                return
            if request_id == "-":  # malformed: refused, and answered with one of the edge's
                request_id = new_request_id()
            err.extra_headers = (*err.extra_headers, (b"x-request-id", request_id.encode()))
            await render_error(send, err, body_writer(scope))
            self.metrics.requests.labels(route, str(err.status), model).inc()
            self._log(ex, scope, route, err.status, t0, err.message, request_id)
            return
        assert ex is not None
        self._account(ex, scope, route, "client disconnected" if ex.disconnected else None)

    def _account(self, ex: Exchange, scope: Scope, route: str, error: str | None) -> None:
        """The audit line, metrics, access log line and span end of a request answered."""
        status = ex.status
        if self.audit is not None:
            self.audit.record_exchange(ex, status)
        self.metrics.requests.labels(route, str(status), ex.model).inc()
        self._log(ex, scope, route, status, ex.t0, error)
        if ex.trace is not None:
            ex.trace.set("http.response.status_code", status)
            ex.trace.set("gen_ai.response.model", self._served_model(ex))
            ex.trace.set("quicedge.retries", ex.retries)
            ex.trace.end(time.perf_counter(), error=error)

    def _finish_admission(self, ex: Exchange) -> None:
        reported = ex.usage.completion_tokens if ex.usage is not None else None
        self.admission.finish(ex, ex.content_chunks if reported is None else reported)

    # -- background responses ----------------------------------------------------------------

    async def _detach(self, ex: Exchange, scope: Scope, receive: Receive, send: Send) -> None:
        """A `background: true` response: record it running, hand the rest of the request to
        a task of its own (`state.detached`: it finishes the request), and answer `queued`
        now, or with `stream`, relay its events for as long as this client stays."""
        state = ex.state
        assert state is not None and self.state is not None
        try:
            queued = await state.queue()
        except BaseException:
            self._finish_admission(ex)
            raise
        ex.on_disconnect = _stays  # its client may go now: the answer does not need it
        ex.body_writer = None
        broadcast = None
        if ex.stream and self.state.events is not None:
            cap = 4 * self.state.config.conversations.max_bytes
            broadcast = Broadcast(self.state.events, ex.tenant, queued["id"], cap)
            assert state.builder is not None
            await broadcast.events(state.builder.announce())  # the id, before any answer
        task = asyncio.get_running_loop().create_task(self._in_background(ex, scope, broadcast))
        state.detached = True
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        # The request's id and its tenant's rate-limit headers, as any answer has them.
        extra = [(b"x-request-id", ex.request_id.encode()), *(ex.ratelimit or ())]
        try:
            if broadcast is None:
                await send_json(send, 200, queued, extra)
            else:
                await _stream_events(send, receive, broadcast.mine(), ex.request_id, extra[1:])
        except ClientGone:  # its answer goes on without it
            pass
        finally:
            if broadcast is not None:
                broadcast.leave()

    async def _in_background(
        self, ex: Exchange, scope: Scope, broadcast: Broadcast | None = None
    ) -> None:
        """Generate a background answer: the relay as for any request, its client a sink; its
        record read every `POLL_S` for a cancel, its turn's lease renewed every third of it;
        bounded by `state.conversations.background_max`."""
        state = ex.state
        assert state is not None and self.state is not None
        loop = asyncio.get_running_loop()
        forward: asyncio.Task[None] | None = None
        try:
            relay_send = await state.begin(_discard if broadcast is None else broadcast.send)
            assert relay_send is not None  # never a cache hit: /v1/responses is not cached
            forward = loop.create_task(self._forward(ex, _no_message, relay_send))
            settings = self.state.config.conversations
            deadline = loop.time() + settings.background_max
            renew_every = settings.lease / 3
            renew_at = loop.time() + renew_every
            try:
                while not forward.done():
                    await asyncio.wait({forward}, timeout=min(POLL_S, renew_every))
                    if forward.done():
                        break
                    if loop.time() >= deadline:
                        late = (
                            "the answer did not complete within state.conversations.background_max"
                        )
                        state.background_error = {"code": "timeout", "message": late}
                        _stop(ex, forward)
                    elif loop.time() >= renew_at and not await state.keep_lease():
                        lost = "its conversation was deleted while the answer ran"
                        state.background_error = {"code": "not_stored", "message": lost}
                        _stop(ex, forward)
                    elif await state.cancel_requested():
                        state.cancelled = True
                        _stop(ex, forward)
                    if loop.time() >= renew_at:
                        renew_at = loop.time() + renew_every
            except asyncio.CancelledError:  # the edge stops
                stopped = "the edge stopped before the answer completed"
                state.background_error = {"code": "edge_stopped", "message": stopped}
                _stop(ex, forward)
            with contextlib.suppress(asyncio.CancelledError):
                await forward
        except EdgeError as err:
            ex.status = ex.status or err.status
            state.background_error = {"code": err.code or "error", "message": err.message}
        except Exception:
            log.exception("request %s: its background answer failed", ex.request_id)
            state.background_error = {"code": "internal_error", "message": "the edge failed"}
            ex.status = ex.status or 500
        finally:
            if forward is not None and not forward.done():
                forward.cancel()
            self._finish_admission(ex)
            await state.finish()
            if broadcast is not None:  # a stream that did not reach its end ends here
                builder = state.builder
                if builder is not None and not builder.ended and not state.cancelled:
                    builder.failed = (
                        builder.failed
                        or state.background_error
                        or {"code": "not_completed", "message": "the answer did not complete"}
                    )
                    await broadcast.events(builder.finish())
                await broadcast.close()
        error = state.background_error
        if state.cancelled:
            ex.status = ex.status or 499
        self._account(ex, scope, RESPONSES, None if error is None else error["message"])

    async def settle_background(self, timeout: float) -> None:
        """Wait up to `timeout` s for the background answers in progress to end (a drain)."""
        if self._background:
            await asyncio.wait(set(self._background), timeout=timeout)

    async def stop_background(self) -> None:
        """Stop the background answers in progress (the edge is stopping): each is recorded
        as failed, `edge_stopped`."""
        tasks = list(self._background)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)

    async def _parse_and_admit(self, ex: Exchange, receive: Receive, tenant: Tenant) -> None:
        """Parse (body, JSON once) then admit (fields, model, routing view, tenant quota)."""
        h = ex.headers
        if self.audit is not None:
            self.audit.admit()  # a full audit queue may refuse new requests (`when_full`)
        check_content_type(h.content_type, h.content_encoding)
        limit = self.config.max_body_bytes
        declared_length(h.content_length, limit)
        raw = await read_body(receive, limit, self.body_budget)
        body = parse_json_object(raw)
        if self.state is not None:  # stored conversations, /v1/responses, the response cache
            raw, body = await self.state.prepare(ex, raw, body)
        elif ex.route == RESPONSES:
            raise RouteNotFound(f"no route for POST {RESPONSES}")
        t_parsed = time.perf_counter()
        ex.stream = validate(ex.route, body)
        model = body.get("model")
        ex.model = self._model_label(model)  # what a 404 for an unknown model is counted as
        if self.models is not None:
            name = None if ex.route == GENERATE else model
            route = self.models.route_now(
                name, tenant=ex.tenant, canary=h.canary, session=h.session
            )
            if route is None:  # a name not known yet: the fleet's list decides (maybe 404)
                route = await self.models.route(
                    name, tenant=ex.tenant, canary=h.canary, session=h.session
                )
                if ex.model == OTHER_MODEL:  # the check may have fetched the list just now
                    ex.model = self._model_label(model)
            ex.model_route = route
        elif ex.route != GENERATE:
            await self.catalog.check(model)
            if ex.model == OTHER_MODEL:  # the check may have fetched the list just now
                ex.model = self._model_label(model)
        if self.gateway is not None:
            raw = self.gateway.stage(ex, body, raw)
        session = h.session.decode("latin-1") if h.session else None
        ex.view = build_view(ex.route, body, session)
        if self.gateway is not None and self.gateway.judge is not None:
            await self.gateway.judge_stage(ex)
        sent: Mapping[str, Any] = body
        if self.models is not None:  # an alias's pool name, a shadow's logprobs
            raw, sent = self.models.prepare(ex, raw, body)
        if ex.route in WHOLE_ROUTES:  # answered at once and never aborted: forwarded as sent
            ex.abort_rid = None
            ex.payload = whole_payload(raw, sent)  # but for the client's `rid`
        else:
            _use_edge_rid(ex, raw, sent)
            if ex.stream and ex.route in USAGE_ROUTES:
                asked = ask_usage(ex.payload, sent)
                if asked is not None:
                    ex.payload, ex.strip_usage = asked, True
        if ex.trace is not None:
            traceparent, tracestate = ex.trace.upstream_context()
        else:  # the client's, within the bounds tracing keeps
            traceparent, tracestate = forwarded_context(h.traceparent, h.tracestate)
        ex.upstream_headers = upstream_headers(
            label=ex.request_id,
            early_data=ex.early_data,
            traceparent=traceparent,
            tracestate=tracestate,
        )
        if h.via is None:  # the common case: a header made once
            ex.upstream_headers.append(self.via.headers.get(ex.transport, self.via.h1))
        else:
            ex.upstream_headers.append(self.via.after(h.via, ex.transport))
        await self.admission.admit(ex, tenant)  # last: nothing after it may fail and leak a slot
        t_admitted = time.perf_counter()
        self.metrics.stage_parse.observe(t_parsed - ex.t0)
        self.metrics.stage_admit.observe(t_admitted - t_parsed)
        if ex.trace is not None:
            ex.trace.stage("parse", ex.t0, t_parsed)
            ex.trace.stage("admit", t_parsed, t_admitted)
            ex.trace.set("quicedge.stream", ex.stream)
            for key, value in genai_request_attributes(body):
                ex.trace.set(key, value)
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
            await self.attempts.run(ex, send)
        except asyncio.CancelledError:
            if ex.judge_refused and not ex.disconnected and self.gateway is not None:
                task.uncancel()
                raise self.gateway.judge_refusal(ex) from None
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


NO_MODEL = "none"
"""The `model` label of a request counted before its body was read (or on a route without one)."""
OTHER_MODEL = "other"
"""The `model` label of a model the fleet does not list (the labels stay as few as its models)."""


def _use_edge_rid(ex: Exchange, raw: bytes, body: Mapping[str, Any]) -> None:
    """The backend's rid is always the edge's own (`edge.stages.forward`); the client's id,
    from its header or its body, is only the label. A batch's rids are derived from the
    edge's and not aborted one by one."""
    from_client = ex.headers.request_id is not None
    rid = ex.abort_rid = upstream_rid(ex.request_id, from_client=from_client)
    if "rid" in body:
        theirs = body["rid"]
        if isinstance(theirs, list):
            ex.abort_rid = None
        elif not from_client and (label := label_from_body(theirs)) is not None:
            ex.request_id = label
            if ex.trace is not None:
                ex.trace.set("quicedge.request_id", label)
    ex.payload = splice_rid(raw, body, rid)


def _default_card(listing: dict[str, Any]) -> dict[str, Any]:
    """`default`, which every backend serves (SGLang's `model` default): chat with it works,
    so its card does too; `root` names the model behind it when the fleet serves one."""
    served = [c["id"] for c in listing.get("data", []) if isinstance(c, dict)]
    card: dict[str, Any] = {"id": DEFAULT_MODEL, "object": "model", "created": 0,
                            "owned_by": "quicedge"}  # fmt: skip
    if len(served) == 1:
        card["root"] = served[0]
    return card


async def _stream_events(
    send: Send,
    receive: Receive,
    events: Any,
    request_id: str,
    extra: Sequence[tuple[bytes, bytes]] = (),
) -> None:
    """Send `events` (an async iterator of SSE bytes) as a 200 event stream until it ends or
    the client goes away."""
    task = asyncio.current_task()
    assert task is not None
    gone = False

    async def watch() -> None:
        nonlocal gone
        while (await receive())["type"] != "http.disconnect":
            pass
        gone = True
        task.cancel()

    watcher = asyncio.get_running_loop().create_task(watch())
    try:
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
            (b"x-request-id", request_id.encode()), *extra]})  # fmt: skip
        try:
            async for chunk in events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except EdgeError as err:  # the head went out: the stream ends here, whole events only
            log.warning("request %s: its event stream ended early: %s", request_id, err)
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    except (ClientGone, asyncio.CancelledError):
        if not gone:
            raise
        task.uncancel()
    finally:
        watcher.cancel()


class _Tracked:
    """A stored route's `send` that notes the status it started its response with: once it
    has, a failure can only end that response, never send a second head."""

    __slots__ = ("send", "status")

    def __init__(self, send: Send) -> None:
        self.send = send
        self.status = 0

    async def __call__(self, message: Any) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        await self.send(message)


def _answer_id(raw: Sequence[tuple[bytes, bytes]]) -> str:
    """The `x-request-id` of an answer outside the inference path: the client's (the last, as
    `read_headers` takes it) when well-formed, else a new one (a malformed one is not echoed)."""
    sent = None
    for name, value in raw:
        if name.lower() == b"x-request-id":
            sent = value
    try:
        return request_id_from(sent)
    except InvalidRequest:
        return new_request_id()


def _head_only(send: Send) -> Send:
    """`send` for a HEAD request: the head as GET's (its `content-length` too), no body."""

    async def sending(message: Any) -> None:
        if message["type"] == "http.response.body":
            message = {**message, "body": b""}
        await send(message)

    return sending


def _stop(ex: Exchange, forward: asyncio.Task[None]) -> None:
    """Stop a background answer as a departed client's: the backend's request is aborted."""
    ex.disconnected = True
    forward.cancel()


def _wants_stream(query: bytes) -> bool:
    return b"stream=" in query and parse_qs(query.decode("latin-1")).get("stream", [""])[-1] in (
        "true", "1")  # fmt: skip


def _stays(callback: Any) -> None:
    """A background answer's `on_disconnect`: its client's going stops nothing."""


async def _discard(message: Any) -> None:
    """A background answer's client: the answer is stored, not sent."""


async def _no_message() -> dict[str, Any]:
    raise RuntimeError("a background answer has no client to read from")


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


def _internal(scope: Scope, request_id: str) -> InternalError:
    """A fault of the edge's own, called from the `except` that caught it: logged with its
    traceback, answered as a 500 in OpenAI's shape rather than the listener's bare one."""
    # %r: the path is the client's, percent-decoded (a %0A would start a forged line)
    log.exception("request %s (%s %r) failed", request_id, scope["method"], scope["path"])
    return InternalError("internal error in the edge; x-request-id names this request in its log")
