"""SGLang's native `/generate`: cumulative text and output_ids, meta_info on every chunk."""

from __future__ import annotations

import time
from typing import Any

from backends.sim.http import HttpRequest, Responder
from backends.sim.logprobs import LogprobSource
from backends.sim.request import SimRequest
from backends.sim.routes_base import DONE, SSE_HEADERS, RouteContext, dumps, native_error, sse
from backends.sim.wire import BadRequest, parse_generate, parse_json


class NativeRoutes(RouteContext):
    def _meta(self, req: SimRequest, *, final: bool) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": req.finish_reason,
            "prompt_tokens": req.prompt_tokens,
            "weight_version": self.config.model_version,
            "total_retractions": req.retractions,
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

    def _generate_output(
        self, req: SimRequest, *, final: bool, logprobs: LogprobSource | None = None
    ) -> dict[str, Any]:
        meta = self._meta(req, final=final)
        if logprobs is not None:  # cumulative, like the text
            meta.update(logprobs.native(self.tokenizer, self._pieces(req), req.output_ids))
        return {
            "text": req.text(),
            "output_ids": req.output_ids,  # serialised at once, no copy needed
            "meta_info": meta,
        }

    async def generate(self, request: HttpRequest, responder: Responder) -> None:
        obj = parse_json(request.body)
        try:
            params = parse_generate(obj, self.tokenizer)
            req = self._submit(params, responder)
        except BadRequest as exc:
            if obj.get("stream") is not True:
                raise
            # SGLang starts a streamed answer before its tokenizer manager validates the
            # request (http_server.py `generate_request`, `stream_results`): a refusal is
            # an error event in a 200 stream, then `[DONE]`.
            await responder.start(200, SSE_HEADERS)
            await responder.write(sse({"error": {"message": str(exc)}}))
            await responder.write(DONE)
            await responder.end()
            return
        timing = self._timing(request, req, responder)
        logprobs = self._logprobs(params)
        if not params.stream:
            if not await self._whole_answer_due(req, responder, native_error):
                return
            await responder.send(200, dumps(self._generate_output(req, final=True,
                                                                  logprobs=logprobs)))  # fmt: skip
            if timing is not None and req.text():
                timing.first_token_at = time.perf_counter()
            return
        # SGLang starts the event stream at once; chunks follow as tokens exist.
        await responder.start(200, SSE_HEADERS)
        sent = 0
        while not responder.disconnected:
            n = req.completion_tokens
            if n > sent or req.finished:
                out = self._generate_output(req, final=req.finished, logprobs=logprobs)
                await responder.write(sse(out))
                sent = n
                if timing is not None and out["text"]:  # the first content, stamped once
                    timing.first_token_at = time.perf_counter()
                    timing = None
                if req.finished:
                    await responder.write(DONE)
                    await responder.end()
                    return
            await req.wait_change()
