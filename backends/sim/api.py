"""Route handlers: SGLang's HTTP API on top of the scheduler (wire format per SGLang 0.5).

Native routes answer errors as `{"error": {"message": ...}}`; OpenAI routes as
`{"object": "error", "message": ..., "type": "Bad Request", "param": null, "code": 400}`;
unknown paths as FastAPI does, `{"detail": "Not Found"}`.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

from backends.sim.config import SimConfig
from backends.sim.http import HttpRequest, Responder
from backends.sim.metrics import SimMetrics
from backends.sim.request import SimRequest
from backends.sim.scheduler import Scheduler
from backends.sim.textgen import OutputPlan
from backends.sim.tokenizer import Tokenizer
from backends.sim.wire import (
    BadRequest,
    GenParams,
    parse_chat,
    parse_completion,
    parse_generate,
    parse_json,
)

JSON = b"application/json"
SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
]
DONE = b"data: [DONE]\n\n"
FLUSH_MESSAGE = (
    b"Cache flushed.\nPlease check backend logs for more details. (When there are running or "
    b"waiting requests, the operation will not be performed.)\n"
)
HEALTH_TIMEOUT = 20.0  # SGLANG_HEALTH_CHECK_TIMEOUT


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def sse(obj: Any) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


def openai_error(message: str, status: int = 400) -> bytes:
    phrase = HTTPStatus(status).phrase
    return dumps(
        {"object": "error", "message": message, "type": phrase, "param": None, "code": status}
    )


def native_error(message: str) -> bytes:
    return dumps({"error": {"message": message}})


Route = Callable[[HttpRequest, Responder], Awaitable[None]]


class Api:
    def __init__(
        self,
        config: SimConfig,
        scheduler: Scheduler,
        *,
        tokenizer: Tokenizer,
        metrics: SimMetrics,
        is_ready: Callable[[], bool],
    ) -> None:
        self.config = config
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.is_ready = is_ready
        self.created = int(time.time())
        # path -> (allowed methods, handler, OpenAI-style errors?)
        self.routes: dict[str, tuple[frozenset[str], Route, bool]] = {}
        get, post = frozenset({"GET"}), frozenset({"POST"})
        both = frozenset({"GET", "POST"})
        for path, methods, handler, openai in (
            ("/generate", frozenset({"POST", "PUT"}), self.generate, False),
            ("/v1/chat/completions", post, self.chat_completions, True),
            ("/v1/completions", post, self.completions, True),
            ("/v1/models", get, self.models, True),
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

    # -- dispatch ------------------------------------------------------------------------------

    async def handle(self, request: HttpRequest, responder: Responder) -> None:
        path = request.path
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

    def _new_request(self, params: GenParams) -> SimRequest:
        n = len(params.input_ids)
        ctx = self.config.effective_context_length
        if n == 0:
            raise BadRequest("The input is empty.")
        if n >= ctx:
            raise BadRequest(
                f"The input ({n} tokens) is longer than the model's context length ({ctx} tokens)."
            )
        max_new = params.max_new_tokens if params.max_new_tokens is not None else ctx - n
        if n + max_new > ctx:
            raise BadRequest(
                f"Requested token count exceeds the model's maximum context length of {ctx} "
                f"tokens. You requested a total of {n + max_new} tokens: {n} tokens from the "
                f"input messages and {max_new} tokens for the completion. Please reduce the "
                "number of tokens in the input messages or the completion to fit within the limit."
            )
        pool = self.scheduler.max_total_tokens
        if n >= pool:
            raise BadRequest(
                f"The input ({n} tokens) does not fit in the KV cache ({pool} tokens)."
            )
        rid = params.rid or uuid.uuid4().hex
        if self.scheduler.get(rid) is not None:
            raise BadRequest(f"Duplicate request ID: {rid}")
        plan = OutputPlan(
            self.tokenizer,
            params.input_ids,
            seed=self.config.seed,
            natural_len=self.config.natural_output_len,
        )
        return SimRequest(
            rid=rid,
            input_ids=params.input_ids,
            max_new_tokens=max_new,
            plan=plan,
            ignore_eos=params.ignore_eos,
            min_new_tokens=params.min_new_tokens,
            stop=params.stop,
            stop_token_ids=params.stop_token_ids,
            no_stop_trim=params.no_stop_trim,
        )

    def _submit(self, params: GenParams, responder: Responder) -> SimRequest:
        req = self._new_request(params)
        self.scheduler.submit(req)
        scheduler = self.scheduler
        # A client that goes away aborts its request and frees its slot (SGLang's abort task).
        responder.on_disconnect = lambda: scheduler.abort(req)
        return req

    @staticmethod
    async def _until_finished(req: SimRequest) -> None:
        while not req.finished:
            await req.wait_change()

    @staticmethod
    def _abort_message(req: SimRequest) -> str | None:
        reason = req.finish_reason
        if reason is not None and reason.get("type") == "abort":
            return str(reason.get("message", "aborted"))
        return None

    def _meta(self, req: SimRequest, *, final: bool) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": req.finish_reason,
            "prompt_tokens": req.prompt_tokens,
            "weight_version": "default",
            "total_retractions": 0,
            "completion_tokens": req.completion_tokens,
            "cached_tokens": req.cached_tokens,
            "cached_tokens_details": None,
            "dp_rank": None,
        }
        if final:
            assert req.finished_at is not None
            meta["e2e_latency"] = req.finished_at - req.created_at
            meta["response_sent_to_client_ts"] = time.time()
        return meta

    def _generate_output(self, req: SimRequest, *, final: bool) -> dict[str, Any]:
        return {
            "text": req.text(),
            "output_ids": list(req.output_ids),
            "meta_info": self._meta(req, final=final),
        }

    async def generate(self, request: HttpRequest, responder: Responder) -> None:
        params = parse_generate(parse_json(request.body), self.tokenizer)
        req = self._submit(params, responder)
        if not params.stream:
            await self._until_finished(req)
            if responder.disconnected:
                return
            message = self._abort_message(req)
            if message is not None:
                await responder.send(400, native_error(message))
                return
            await responder.send(200, dumps(self._generate_output(req, final=True)))
            return
        # SGLang starts the event stream at once; chunks follow as tokens exist.
        await responder.start(200, SSE_HEADERS)
        sent = 0
        while not responder.disconnected:
            n = req.completion_tokens
            if n > sent or req.finished:
                await responder.write(sse(self._generate_output(req, final=req.finished)))
                sent = n
                if req.finished:
                    await responder.write(DONE)
                    await responder.end()
                    return
            await req.wait_change()

    def _usage(self, req: SimRequest) -> dict[str, Any]:
        cached = req.cached_tokens
        details = {"cached_tokens": cached} if self.config.enable_cache_report and cached else None
        return {
            "prompt_tokens": req.prompt_tokens,
            "total_tokens": req.prompt_tokens + req.completion_tokens,
            "completion_tokens": req.completion_tokens,
            "prompt_tokens_details": details,
            "reasoning_tokens": 0,
        }

    @staticmethod
    def _finish_fields(req: SimRequest) -> tuple[str | None, Any]:
        reason = req.finish_reason
        if reason is None:
            return None, None
        return reason["type"], reason.get("matched")

    async def _first_output(self, req: SimRequest, responder: Responder) -> bool:
        """OpenAI routes send the 200 only with the first chunk (SGLang kick-starts the
        generator to surface errors first). False if the client or the request is gone."""
        while req.completion_tokens == 0 and not req.finished:
            await req.wait_change()
        if responder.disconnected:
            return False
        message = self._abort_message(req)
        if message is not None and req.completion_tokens == 0:
            await responder.send(400, openai_error(message))
            return False
        await responder.start(200, SSE_HEADERS)
        return True

    async def chat_completions(self, request: HttpRequest, responder: Responder) -> None:
        self._require_json(request)
        obj = parse_json(request.body)
        params = parse_chat(obj, self.tokenizer)
        req = self._submit(params, responder)
        model = params.model or self.config.model_name
        created = int(time.time())
        if not params.stream:
            await self._until_finished(req)
            if responder.disconnected:
                return
            message = self._abort_message(req)
            if message is not None:
                await responder.send(400, openai_error(message))
                return
            reason, matched = self._finish_fields(req)
            body = {
                "id": req.rid,
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "message": {
                            "role": "assistant",
                            "content": req.text(),
                            "reasoning_content": None,
                            "tool_calls": None,
                        },
                        "logprobs": None,
                        "finish_reason": reason,
                        "matched_stop": matched,
                    }
                ],
                "usage": self._usage(req),
                "metadata": {"weight_version": "default"},
            }
            await responder.send(200, dumps(body))
            return
        if not await self._first_output(req, responder):
            return
        head = {
            "id": req.rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
        }

        def chunk(delta: dict[str, Any], reason: str | None = None, matched: Any = None) -> bytes:
            choice = {
                "index": 0,
                "delta": delta,
                "logprobs": None,
                "finish_reason": reason,
                "matched_stop": matched,
            }
            out = {**head, "choices": [choice]}
            if params.continuous_usage_stats:
                out["usage"] = self._usage(req)
            return sse(out)

        # Role chunk, together with the first token (never before it exists).
        await responder.write(
            chunk({"reasoning_content": None, "role": "assistant", "content": ""})
        )
        sent_tokens = sent_chars = 0
        while not responder.disconnected:
            if req.completion_tokens > sent_tokens:
                sent_tokens = req.completion_tokens
                text = req.text()
                delta, sent_chars = text[sent_chars:], len(text)
                if delta:
                    await responder.write(chunk({"reasoning_content": None, "content": delta}))
            if req.finished:
                message = self._abort_message(req)
                if message is not None:
                    await responder.write(
                        sse(
                            {
                                "error": {
                                    "message": message,
                                    "type": "Bad Request",
                                    "param": None,
                                    "code": 400,
                                }
                            }
                        )
                    )
                else:
                    reason, matched = self._finish_fields(req)
                    empty = {
                        "role": None,
                        "content": None,
                        "reasoning_content": None,
                        "tool_calls": None,
                    }
                    await responder.write(chunk(empty, reason, matched))
                    if params.include_usage:
                        await responder.write(
                            sse({**head, "choices": [], "usage": self._usage(req)})
                        )
                await responder.write(DONE)
                await responder.end()
                return
            await req.wait_change()

    async def completions(self, request: HttpRequest, responder: Responder) -> None:
        self._require_json(request)
        params = parse_completion(parse_json(request.body), self.tokenizer)
        req = self._submit(params, responder)
        model = params.model or self.config.model_name
        created = int(time.time())
        if not params.stream:
            await self._until_finished(req)
            if responder.disconnected:
                return
            message = self._abort_message(req)
            if message is not None:
                await responder.send(400, openai_error(message))
                return
            reason, matched = self._finish_fields(req)
            body = {
                "id": req.rid,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "text": req.text(),
                        "logprobs": None,
                        "finish_reason": reason,
                        "matched_stop": matched,
                    }
                ],
                "usage": self._usage(req),
                "metadata": {"weight_version": "default"},
            }
            await responder.send(200, dumps(body))
            return
        if not await self._first_output(req, responder):
            return
        head = {"id": req.rid, "object": "text_completion", "created": created, "model": model}
        sent_tokens = sent_chars = 0
        while not responder.disconnected:
            new = req.completion_tokens > sent_tokens
            if new or req.finished:
                sent_tokens = req.completion_tokens
                text = req.text()
                delta, sent_chars = text[sent_chars:], len(text)
                message = self._abort_message(req)
                if message is not None:
                    await responder.write(
                        sse(
                            {
                                "error": {
                                    "message": message,
                                    "type": "Bad Request",
                                    "param": None,
                                    "code": 400,
                                }
                            }
                        )
                    )
                    await responder.write(DONE)
                    await responder.end()
                    return
                # finish_reason rides on the last content chunk (no separate finish chunk).
                reason, matched = self._finish_fields(req)
                if delta or reason is not None:
                    choice = {
                        "index": 0,
                        "text": delta,
                        "logprobs": None,
                        "finish_reason": reason,
                        "matched_stop": matched,
                    }
                    out: dict[str, Any] = {**head, "choices": [choice], "usage": None}
                    if params.continuous_usage_stats:
                        out["usage"] = self._usage(req)
                    await responder.write(sse(out))
                if req.finished:
                    if params.include_usage:
                        usage = {k: v for k, v in self._usage(req).items() if v is not None}
                        await responder.write(sse({**head, "choices": [], "usage": usage}))
                    await responder.write(DONE)
                    await responder.end()
                    return
            await req.wait_change()

    @staticmethod
    def _require_json(request: HttpRequest) -> None:
        content_type = request.header(b"content-type") or b""
        if not content_type.split(b";")[0].strip().lower() == b"application/json":
            raise BadRequest("Unsupported Media Type: Only 'application/json' is allowed")

    # -- information and control ---------------------------------------------------------------

    def _model_card(self) -> dict[str, Any]:
        name = self.config.model_name
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "sglang",
            "root": name,
            "parent": None,
            "max_model_len": self.config.effective_context_length,
        }

    async def models(self, request: HttpRequest, responder: Responder) -> None:
        await responder.send(200, dumps({"object": "list", "data": [self._model_card()]}))

    async def model_card(self, request: HttpRequest, responder: Responder) -> None:
        wanted = request.path[len("/v1/models/") :]
        if wanted != self.config.model_name:
            error = {
                "message": f"The model '{wanted}' does not exist",
                "type": "invalid_request_error",
                "param": "model",
                "code": "model_not_found",
            }
            await responder.send(404, dumps({"error": error}))
            return
        await responder.send(200, dumps(self._model_card()))

    async def ping(self, request: HttpRequest, responder: Responder) -> None:
        await responder.send(200, b"", b"text/plain; charset=utf-8")

    async def health(self, request: HttpRequest, responder: Responder) -> None:
        """503 until warmed up; then a 1-token generation must come back (SGLang's check)."""
        if not self.is_ready():
            await responder.send(503, b"", b"text/plain; charset=utf-8")
            return
        if self.scheduler.idle:
            req = SimRequest(
                rid=f"HEALTH_CHECK_{uuid.uuid4().hex}",
                input_ids=[0],
                max_new_tokens=1,
                plan=OutputPlan(self.tokenizer, [0], seed=0, natural_len=(1, 1)),
                ignore_eos=True,
                log_metrics=False,
            )
            self.scheduler.submit(req)
            try:
                await asyncio.wait_for(self._until_finished(req), HEALTH_TIMEOUT)
            except TimeoutError:
                self.scheduler.abort(req)
                await responder.send(503, b"", b"text/plain; charset=utf-8")
                return
        # "If the server is running something, this request will be ignored": it is alive.
        await responder.send(200, b"", b"text/plain; charset=utf-8")

    async def model_info(self, request: HttpRequest, responder: Responder) -> None:
        path = self.config.timing.model_path
        body = {
            "model_path": path,
            "tokenizer_path": path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
        }
        await responder.send(200, dumps(body))

    async def server_info(self, request: HttpRequest, responder: Responder) -> None:
        cfg, s = self.config, self.scheduler
        body = {
            "model_path": cfg.timing.model_path,
            "tokenizer_path": cfg.timing.model_path,
            "served_model_name": cfg.model_name,
            "host": cfg.host,
            "port": cfg.port,
            "context_length": cfg.effective_context_length,
            "page_size": cfg.page_size,
            "chunked_prefill_size": cfg.chunked_prefill_size,
            "max_prefill_tokens": cfg.max_prefill_tokens,
            "max_running_requests": s.max_running,
            "max_total_tokens": s.max_total_tokens,
            "schedule_policy": "fcfs",
            "radix_eviction_policy": "lru",
            "disable_radix_cache": cfg.disable_radix_cache,
            "enable_cache_report": cfg.enable_cache_report,
            "enable_metrics": cfg.enable_metrics,
            "stream_interval": 1,
            "stream_output": False,
            "random_seed": cfg.seed,
            "device": "cuda",
            "tp_size": 1,
            "dp_size": 1,
            "scheduler_info": {
                "status": "ready" if self.is_ready() else "starting",
                "max_total_num_tokens": s.max_total_tokens,
                "max_req_input_len": min(cfg.effective_context_length, s.max_total_tokens) - 1,
            },
            "internal_states": [
                {
                    "last_gen_throughput": s.gen_throughput(),
                    "avg_spec_accept_length": None,
                    "effective_max_running_requests_per_dp": s.max_running,
                    "memory_usage": {
                        "weight": 0.0,
                        "kvcache": 0.0,
                        "token_capacity": s.max_total_tokens,
                        "graph": 0.0,
                    },
                }
            ],
            "version": "0.5.0-quicedge-sim",
            "sim": {"name": cfg.name, "profile": cfg.profile, "time_scale": cfg.time_scale},
        }
        await responder.send(200, dumps(body))

    def _rank_load(self) -> dict[str, Any]:
        s = self.scheduler
        return {
            "dp_rank": 0,
            "num_running_reqs": s.num_running,
            "num_waiting_reqs": s.num_waiting,
            "num_used_tokens": s.used_tokens,
            "num_total_tokens": s.used_tokens,
            "max_total_num_tokens": s.max_total_tokens,
            "max_running_requests": s.max_running,
            "token_usage": round(s.token_usage, 4),
            "gen_throughput": s.gen_throughput(),
            "cache_hit_rate": s.stats.last_cache_hit_rate,
            "num_waiting_uncached_tokens": sum(r.prompt_tokens for r in s.waiting),
        }

    async def loads(self, request: HttpRequest, responder: Responder) -> None:
        body = {"timestamp": time.time(), "dp_rank_count": 1, "loads": [self._rank_load()]}
        await responder.send(200, dumps(body))

    async def get_load(self, request: HttpRequest, responder: Responder) -> None:
        """Legacy list form: one entry per DP rank."""
        s = self.scheduler
        entry = {
            "dp_rank": 0,
            "num_reqs": s.num_running + s.num_waiting,
            "num_waiting_reqs": s.num_waiting,
            "num_tokens": s.used_tokens,
            "num_pending_tokens": sum(r.prompt_tokens for r in s.waiting),
            "ts_tic": time.time(),
        }
        await responder.send(200, dumps([entry]))

    async def flush_cache(self, request: HttpRequest, responder: Responder) -> None:
        status = 200 if self.scheduler.flush_cache() else 400
        await responder.send(status, FLUSH_MESSAGE, b"text/plain; charset=utf-8")

    async def abort_request(self, request: HttpRequest, responder: Responder) -> None:
        obj = parse_json(request.body)
        rid = obj.get("rid")
        abort_all = obj.get("abort_all", False)
        if not isinstance(abort_all, bool):
            raise BadRequest("'abort_all' must be a boolean")
        if abort_all:
            self.scheduler.abort_all()
        elif isinstance(rid, str) and rid:
            req = self.scheduler.get(rid)
            if req is not None:
                self.scheduler.abort(req, "Abort requested by /abort_request.")
        else:
            raise BadRequest("'rid' (a non-empty string) or 'abort_all': true is required")
        # SGLang answers 200 with an empty body whether or not the rid was known.
        await responder.send(200, b"", b"text/plain; charset=utf-8")

    async def prometheus(self, request: HttpRequest, responder: Responder) -> None:
        await responder.send(
            200, self.metrics.render(), b"text/plain; version=0.0.4; charset=utf-8"
        )
