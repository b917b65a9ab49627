"""Health, information, load, cache and abort routes, and `/metrics`."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from backends.sim.http import HttpRequest, Responder
from backends.sim.request import SimRequest
from backends.sim.routes_base import FLUSH_MESSAGE, HEALTH_TIMEOUT, RouteContext, dumps
from backends.sim.textgen import OutputPlan
from backends.sim.wire import BadRequest, parse_json


class AdminRoutes(RouteContext):
    async def ping(self, request: HttpRequest, responder: Responder) -> None:
        await responder.send(200, b"", b"text/plain; charset=utf-8")

    async def health(self, request: HttpRequest, responder: Responder) -> None:
        """503 until warmed up; then a 1-token generation must come back (SGLang's check).
        With `health_poll`, the answer waits as SGLang's does: it sleeps `health_poll`, then
        looks whether the check (or, on a busy server, any request) produced output, and
        again until it did, so a 200 never comes sooner than `health_poll`."""
        if not self.is_ready():
            await responder.send(503, b"", b"text/plain; charset=utf-8")
            return
        req = None
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
            async with asyncio.timeout(HEALTH_TIMEOUT):
                poll = self.config.health_poll
                while True:
                    if poll:
                        await asyncio.sleep(poll)
                    if req is None or req.finished:
                        break
                    if not poll:
                        await self._until_finished(req)
        except TimeoutError:
            if req is not None:
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
            "weight_version": self.config.model_version,
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
            "num_used_tokens": s.in_use_tokens,
            "num_total_tokens": s.in_use_tokens,
            "max_total_num_tokens": s.max_total_tokens,
            "max_running_requests": s.max_running,
            "token_usage": round(s.token_usage, 4),
            "gen_throughput": s.gen_throughput(),
            "cache_hit_rate": s.stats.last_cache_hit_rate,
            "num_waiting_uncached_tokens": sum(r.prompt_tokens for r in s.waiting),
            "num_retracted_reqs": s.stats.num_retracted_reqs_total,
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
            "num_tokens": s.in_use_tokens,
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
                self.scheduler.abort(req)
        else:
            raise BadRequest("'rid' (a non-empty string) or 'abort_all': true is required")
        # SGLang answers 200 with an empty body whether or not the rid was known.
        await responder.send(200, b"", b"text/plain; charset=utf-8")

    async def debug_timings(self, request: HttpRequest, responder: Responder) -> None:
        """The kept records, oldest first (routed only with `--record-timings`)."""
        records = [
            {"rid": t.rid, "read_at": t.read_at, "first_token_at": t.first_token_at}
            for t in self.timings or ()
        ]
        await responder.send(200, dumps({"clock": "perf_counter", "timings": records}))

    async def prometheus(self, request: HttpRequest, responder: Responder) -> None:
        await responder.send(
            200, self.metrics.render(), b"text/plain; version=0.0.4; charset=utf-8"
        )
