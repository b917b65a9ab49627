"""SGLang's native `/generate`: cumulative text and output_ids, meta_info on every chunk."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from backends.sim.http import HttpRequest, Responder
from backends.sim.logprobs import LogprobSource
from backends.sim.request import SimRequest
from backends.sim.routes_base import DONE, SSE_HEADERS, RouteContext, dumps, native_error, sse
from backends.sim.wire import (
    BadRequest,
    GenParams,
    parse_generate,
    parse_generate_batch,
    parse_json,
)


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
            batch = parse_generate_batch(obj, self.tokenizer)
            if batch is not None:
                reqs = self._submit_batch(batch, responder)
            else:
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
        if batch is not None:
            await self._generate_batch(request, responder, batch, reqs)
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

    async def _generate_batch(
        self,
        request: HttpRequest,
        responder: Responder,
        batch: list[GenParams],
        reqs: list[SimRequest],
    ) -> None:
        """A batch (tokenizer_manager.py `_handle_batch_request`): whole, the list of outputs in
        prompt order once all are done (a 400 if one ended in error); streamed, each output
        as it comes with its prompt's `index`, then `[DONE]` once all are done."""
        timing = self._timing(request, reqs[0], responder)
        logprobs = [self._logprobs(params) for params in batch]
        if not batch[0].stream:
            for req in reqs:
                await self._until_finished(req)
            if responder.disconnected:
                return
            for req in reqs:
                message = self._abort_message(req)
                if message is not None:
                    await responder.send(400, native_error(message))
                    return
            outputs = [
                self._generate_output(req, final=True, logprobs=lps)
                for req, lps in zip(reqs, logprobs, strict=True)
            ]
            await responder.send(200, dumps(outputs))
            if timing is not None and any(o["text"] for o in outputs):
                timing.first_token_at = time.perf_counter()
            return
        await responder.start(200, SSE_HEADERS)
        sent = [0] * len(reqs)
        done = [False] * len(reqs)
        while not responder.disconnected:
            wrote = False
            for i, req in enumerate(reqs):
                n = req.completion_tokens
                if done[i] or not (n > sent[i] or req.finished):
                    continue
                out = self._generate_output(req, final=req.finished, logprobs=logprobs[i])
                out["index"] = i
                await responder.write(sse(out))
                sent[i], done[i], wrote = n, req.finished, True
                if timing is not None and out["text"]:  # the first content, stamped once
                    timing.first_token_at = time.perf_counter()
                    timing = None
            if all(done):
                await responder.write(DONE)
                await responder.end()
                return
            if wrote:  # a write awaited: look again before waiting, so no change is missed
                continue
            waits = [
                asyncio.ensure_future(r.wait_change())
                for r, d in zip(reqs, done, strict=True)
                if not d
            ]
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
