"""The route table: SGLang's HTTP API on top of the scheduler (wire format per SGLang 0.5).

Unknown paths answer as FastAPI does, `{"detail": "Not Found"}`; a wrong method gets 405.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Callable

from backends.sim.config import SimConfig
from backends.sim.http import HttpRequest, Responder
from backends.sim.metrics import SimMetrics
from backends.sim.routes_admin import AdminRoutes
from backends.sim.routes_base import native_error, openai_error
from backends.sim.routes_embed import EmbedRoutes
from backends.sim.routes_native import NativeRoutes
from backends.sim.routes_openai import OpenAIRoutes
from backends.sim.scheduler import Scheduler
from backends.sim.tokenizer import Tokenizer
from backends.sim.wire import BadRequest

Route = Callable[[HttpRequest, Responder], Awaitable[None]]


class Api(NativeRoutes, OpenAIRoutes, EmbedRoutes, AdminRoutes):
    def __init__(
        self,
        config: SimConfig,
        scheduler: Scheduler,
        *,
        tokenizer: Tokenizer,
        metrics: SimMetrics,
        is_ready: Callable[[], bool],
    ) -> None:
        super().__init__(config, scheduler, tokenizer=tokenizer, metrics=metrics, is_ready=is_ready)
        key = config.api_key
        self._auth = b"Bearer " + key.encode() if key else None
        self.requests: Counter[str] = Counter()
        """Every request received, by path (tests read which routes a proxy called)."""
        self.refused: Counter[str] = Counter()
        """Requests answered 401 (no or a wrong key), by path."""
        # path -> (allowed methods, handler, OpenAI-style errors?)
        self.routes: dict[str, tuple[frozenset[str], Route, bool]] = {}
        get, post = frozenset({"GET"}), frozenset({"POST"})
        both = frozenset({"GET", "POST"})
        for path, methods, handler, openai in (
            ("/generate", frozenset({"POST", "PUT"}), self.generate, False),
            ("/v1/chat/completions", post, self.chat_completions, True),
            ("/v1/completions", post, self.completions, True),
            ("/v1/models", get, self.models, True),
            ("/v1/embeddings", post, self.embeddings, True),
            ("/v1/rerank", post, self.rerank, True),
            ("/tokenize", post, self.tokenize, True),
            ("/v1/tokenize", post, self.tokenize, True),
            ("/detokenize", post, self.detokenize, True),
            ("/v1/detokenize", post, self.detokenize, True),
            ("/health", get, self.health, False),
            ("/health_generate", get, self.health, False),
            ("/ping", get, self.ping, False),
            ("/model_info", get, self.model_info, False),
            ("/get_model_info", get, self.model_info, False),
            ("/server_info", get, self.server_info, False),
            ("/get_server_info", get, self.server_info, False),
            ("/v1/loads", get, self.loads, False),
            ("/get_load", get, self.get_load, False),
            ("/flush_cache", both, self.flush_cache, False),
            ("/abort_request", post, self.abort_request, False),
            ("/metrics", get, self.prometheus, False),
        ):
            self.routes[path] = (methods, handler, openai)
        if self.timings is not None:  # otherwise 404, as an unknown path
            self.routes["/debug/timings"] = (get, self.debug_timings, False)

    # -- dispatch ------------------------------------------------------------------------------

    async def handle(self, request: HttpRequest, responder: Responder) -> None:
        path = request.path
        self.requests[path] += 1
        if (
            self._auth is not None
            and not _auth_exempt(request)
            and (request.header(b"authorization") != self._auth)
        ):
            self.refused[path] += 1
            await responder.send(401, b'{"error":"Unauthorized"}')
            return
        entry = self.routes.get(path)
        if entry is None and path.startswith("/v1/models/"):
            entry = (frozenset({"GET"}), self.model_card, True)
        if entry is None or (path == "/metrics" and not self.config.enable_metrics):
            await responder.send(404, b'{"detail":"Not Found"}')
            return
        methods, handler, openai = entry
        if request.method not in methods:
            await responder.send(405, b'{"detail":"Method Not Allowed"}')
            return
        try:
            await handler(request, responder)
        except BadRequest as exc:
            if responder.started:
                raise
            body = openai_error(str(exc), exc.status) if openai else native_error(str(exc))
            await responder.send(exc.status, body)

    # -- generation ----------------------------------------------------------------------------


def _auth_exempt(request: HttpRequest) -> bool:
    """SGLang's `add_api_key_middleware` lets these through without a key."""
    path = request.path
    return request.method == "OPTIONS" or path.startswith("/health") or path == "/metrics"
