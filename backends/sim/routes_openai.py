"""OpenAI-compatible `/v1/chat/completions`, `/v1/completions` and `/v1/models`, with SGLang's
chunk order: role chunk (with the first token) -> content chunks -> finish chunk (chat) ->
usage chunk (`stream_options.include_usage`) -> `[DONE]`. A chat answer that calls a function
(backends/sim/tools.py) sends, instead of content chunks, one chunk that opens the call (id, name,
the arguments so far) and then one argument chunk per output.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from typing import Any

from backends.sim.http import HttpRequest, Responder
from backends.sim.request import SimRequest
from backends.sim.routes_base import (
    DONE,
    SSE_HEADERS,
    RouteContext,
    Timing,
    dumps,
    openai_error,
    sse,
)
from backends.sim.textgen import TokenPlan
from backends.sim.tools import ToolCall, ToolCallPlan
from backends.sim.wire import BadRequest, GenParams, parse_chat, parse_completion, parse_json

DEFAULT_MODEL = "default"
"""The `model` of a request that names none (SGLang's protocol.py `DEFAULT_MODEL_NAME`); an
answer names the request's model, not the served one."""

ChunkMaker = Callable[..., bytes]
"""A chat stream's chunk builder: (delta, finish_reason=None, matched=None, logprobs=None)."""


class OpenAIRoutes(RouteContext):
    def _usage(self, req: SimRequest) -> dict[str, Any]:
        cached = req.cached_tokens
        details = {"cached_tokens": cached} if self.config.enable_cache_report and cached else None
        return {
            "prompt_tokens": req.prompt_tokens,
            "total_tokens": req.prompt_tokens + req.completion_tokens,
            "completion_tokens": req.completion_tokens,
            "prompt_tokens_details": details,
            "reasoning_tokens": min(req.completion_tokens, req.thinking),
        }

    @staticmethod
    def _finish_fields(req: SimRequest) -> tuple[str | None, Any]:
        reason = req.finish_reason
        if reason is None:
            return None, None
        return reason["type"], reason.get("matched")

    @classmethod
    def _call_finish(cls, req: SimRequest) -> tuple[str | None, Any]:
        """A function call's finish: `length` when max_tokens cut its arguments, `abort` when
        it was aborted, else `tool_calls` (no matched stop, as SGLang's parser reports it)."""
        reason, matched = cls._finish_fields(req)
        if reason in ("length", "abort"):
            return reason, matched
        return "tool_calls", None

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
        # Guard mode: the answer is the verdict on the messages (validated by parse_chat).
        plan: TokenPlan | None = None
        call = None
        if self.guard:
            plan = self.guard.plan(obj["messages"], self.tokenizer)
        elif params.tool_call is not None:
            # A function call: the answer is its arguments (a guard never calls tools).
            call = params.tool_call
            plan = ToolCallPlan(self.tokenizer, call.arguments)
        elif params.structured is not None:
            # A response_format: the answer's text is the JSON it asks for.
            plan = ToolCallPlan(self.tokenizer, params.structured)
        # A reasoning model thinks before it answers (not a guard, a call or a fixed format)
        thinking = self.config.reasoning_tokens if plan is None and params.thinking else 0
        if params.n > 1:
            if plan is not None or thinking or params.logprobs:
                raise BadRequest(
                    "'n' > 1 with tools, response_format, logprobs, thinking or guard mode "
                    "is not supported by the stand-in"
                )
            await self._many_choices(request, responder, params, chat=True)
            return
        req = self._submit(params, responder, plan)
        req.thinking = thinking
        timing = self._timing(request, req, responder)
        model = params.model or DEFAULT_MODEL  # the name asked for, as SGLang answers
        created = int(time.time())
        logprobs = self._logprobs(params)
        if not params.stream:
            if not await self._whole_answer_due(req, responder, openai_error):
                return
            reason, matched = self._finish_fields(req)
            message: dict[str, Any] = {
                "role": "assistant",
                "content": req.text(),
                "reasoning_content": None,
                "tool_calls": None,
            }
            if thinking:
                message["reasoning_content"] = "".join(req.pieces[:thinking]) or None
                message["content"] = "".join(req.pieces[thinking:])
            if call is not None:
                reason, matched = self._call_finish(req)
                message["content"] = None
                message["tool_calls"] = [
                    {
                        "id": call.id,
                        "index": 0,
                        "type": "function",
                        "function": {"name": call.name, "arguments": req.text()},
                    }
                ]
            body = {
                "id": req.rid,
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "message": message,
                        "logprobs": None
                        if logprobs is None
                        else {"content": logprobs.chat_content(self._pieces(req))},
                        "finish_reason": reason,
                        "matched_stop": matched,
                    }
                ],
                "usage": self._usage(req),
                "metadata": {"weight_version": self.config.model_version},
            }
            await responder.send(200, dumps(body))
            if timing is not None and req.text():
                timing.first_token_at = time.perf_counter()
            return
        if not await self._first_output(req, responder):
            return
        head = {
            "id": req.rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
        }

        def chunk(
            delta: dict[str, Any],
            reason: str | None = None,
            matched: Any = None,
            lps: list[dict[str, Any]] | None = None,
        ) -> bytes:
            choice = {
                "index": 0,
                "delta": delta,
                "logprobs": None if lps is None else {"content": lps},
                "finish_reason": reason,
                "matched_stop": matched,
            }
            out = {**head, "choices": [choice]}
            if params.continuous_usage_stats:
                out["usage"] = self._usage(req)
            return sse(out)

        # Content chunks are the hot path: splice the delta into pre-serialised bytes, which
        # equal what `chunk()` would produce (same keys, same order, compact separators).
        content_prefix = (
            b"data: "
            + dumps(head)[:-1]
            + b',"choices":[{"index":0,"delta":{"reasoning_content":null,"content":'
        )
        content_suffix = b'},"logprobs":null,"finish_reason":null,"matched_stop":null}]}\n\n'

        def content_chunk(delta: str, start: int) -> bytes:
            if logprobs is not None:
                lps = logprobs.chat_content(self._pieces(req), start)
                return chunk({"reasoning_content": None, "content": delta}, lps=lps)
            if params.continuous_usage_stats:
                return chunk({"reasoning_content": None, "content": delta})
            return content_prefix + dumps(delta) + content_suffix

        # Role chunk, together with the first token (never before it exists).
        await responder.write(
            chunk({"reasoning_content": None, "role": "assistant", "content": ""})
        )
        if call is not None:
            await self._stream_call(req, responder, call, chunk, head, params, timing)
            return
        sent_tokens = sent_chars = 0
        while not responder.disconnected:
            if req.completion_tokens > sent_tokens:
                start, sent_tokens = sent_tokens, req.completion_tokens
                if start < thinking:  # the thinking first, as reasoning_content
                    split = min(sent_tokens, thinking)
                    thought = "".join(req.pieces[start:split])
                    if thought:
                        await responder.write(chunk({"reasoning_content": thought,
                                                     "content": None}))  # fmt: skip
                        if timing is not None:  # the first token, stamped once
                            timing.first_token_at = time.perf_counter()
                            timing = None
                    start, sent_chars = split, len("".join(req.pieces[:split]))
                text = req.text()
                delta, sent_chars = text[sent_chars:], len(text)
                if delta:
                    await responder.write(content_chunk(delta, start))
                    if timing is not None:  # the first content, stamped once
                        timing.first_token_at = time.perf_counter()
                        timing = None
            if req.finished:
                await self._end_chat_stream(
                    req, responder, chunk, head, params, self._finish_fields(req)
                )
                return
            await req.wait_change()

    async def _stream_call(
        self,
        req: SimRequest,
        responder: Responder,
        call: ToolCall,
        chunk: ChunkMaker,
        head: dict[str, Any],
        params: GenParams,
        timing: Timing | None,
    ) -> None:
        """The rest of a streamed function call, after the role chunk: one chunk opens the call
        (id, name and the arguments so far), then one per later output with its argument text,
        then the finish chunk (`tool_calls`, or `length` when max_tokens cut the arguments)."""
        sent_tokens = sent_chars = 0
        opened = False
        while not responder.disconnected:
            if not opened or req.completion_tokens > sent_tokens:
                sent_tokens = req.completion_tokens
                text = req.text()
                delta, sent_chars = text[sent_chars:], len(text)
                if not opened:
                    function = {"name": call.name, "arguments": delta}
                    opening = {"index": 0, "id": call.id, "type": "function", "function": function}
                    await responder.write(chunk({"tool_calls": [opening]}))
                    opened = True
                    if timing is not None:  # the call's first chunk, stamped once
                        timing.first_token_at = time.perf_counter()
                        timing = None
                elif delta:
                    more = {"index": 0, "function": {"arguments": delta}}
                    await responder.write(chunk({"tool_calls": [more]}))
            if req.finished:
                await self._end_chat_stream(
                    req, responder, chunk, head, params, self._call_finish(req)
                )
                return
            await req.wait_change()

    async def _end_chat_stream(
        self,
        req: SimRequest,
        responder: Responder,
        chunk: ChunkMaker,
        head: dict[str, Any],
        params: GenParams,
        finish: tuple[str | None, Any],
    ) -> None:
        """A finished chat stream's tail: the error event of an aborted request, or the finish
        chunk and the usage chunk (when asked); then `[DONE]`."""
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
            reason, matched = finish
            empty = {
                "role": None,
                "content": None,
                "reasoning_content": None,
                "tool_calls": None,
            }
            await responder.write(chunk(empty, reason, matched))
            if params.include_usage:
                await responder.write(sse({**head, "choices": [], "usage": self._usage(req)}))
        await responder.write(DONE)
        await responder.end()

    async def completions(self, request: HttpRequest, responder: Responder) -> None:
        self._require_json(request)
        params = parse_completion(parse_json(request.body), self.tokenizer)
        if params.n > 1 or params.prompts:
            if params.logprobs:
                raise BadRequest(
                    "'logprobs' with 'n' > 1 or a batch of prompts is not supported by the stand-in"
                )
            await self._many_choices(request, responder, params, chat=False)
            return
        req = self._submit(params, responder)
        timing = self._timing(request, req, responder)
        model = params.model or DEFAULT_MODEL  # the name asked for, as SGLang answers
        created = int(time.time())
        logprobs = self._logprobs(params)
        if not params.stream:
            if not await self._whole_answer_due(req, responder, openai_error):
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
                        "logprobs": None
                        if logprobs is None
                        else logprobs.completion(self._pieces(req)),
                        "finish_reason": reason,
                        "matched_stop": matched,
                    }
                ],
                "usage": self._usage(req),
                "metadata": {"weight_version": self.config.model_version},
            }
            await responder.send(200, dumps(body))
            if timing is not None and req.text():
                timing.first_token_at = time.perf_counter()
            return
        if not await self._first_output(req, responder):
            return
        head = {"id": req.rid, "object": "text_completion", "created": created, "model": model}
        sent_tokens = sent_chars = 0
        while not responder.disconnected:
            new = req.completion_tokens > sent_tokens
            if new or req.finished:
                start, sent_tokens = sent_tokens, req.completion_tokens
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
                # the new tokens' logprobs, as SGLang sends them on every chunk
                lps = None if logprobs is None or not new else logprobs.completion(
                    self._pieces(req), start)  # fmt: skip
                if delta or reason is not None or lps is not None:
                    choice = {
                        "index": 0,
                        "text": delta,
                        "logprobs": lps,
                        "finish_reason": reason,
                        "matched_stop": matched,
                    }
                    out: dict[str, Any] = {**head, "choices": [choice], "usage": None}
                    if params.continuous_usage_stats:
                        out["usage"] = self._usage(req)
                    await responder.write(sse(out))
                    if timing is not None and delta:  # the first content, stamped once
                        timing.first_token_at = time.perf_counter()
                        timing = None
                if req.finished:
                    if params.include_usage:
                        usage = {k: v for k, v in self._usage(req).items() if v is not None}
                        await responder.write(sse({**head, "choices": [], "usage": usage}))
                    await responder.write(DONE)
                    await responder.end()
                    return
            await req.wait_change()

    # -- several choices: `n` > 1, or a batch of completion prompts -------------------------------

    def _submit_choices(self, params: GenParams, responder: Responder) -> list[SimRequest]:
        """One request per choice, in SGLang's order (tokenizer_manager.py
        `_handle_batch_request`): prompt i's choice j is index i * n + j. With n > 1 every choice
        gets a fresh rid (`regenerate_rid`); a batch with n = 1 names its prompts `rid_0`,
        `rid_1`, ... when the request names a rid. All are checked before any is scheduled."""
        n = params.n
        reqs: list[SimRequest] = []
        for i, ids in enumerate(params.prompts or [params.input_ids]):
            for j in range(n):
                rid = f"{params.rid}_{i}" if n == 1 and params.rid is not None else None
                one = dataclasses.replace(params, input_ids=ids, rid=rid, prompts=[])
                reqs.append(self._new_request(one, sample=j))
        changed = asyncio.Event()  # shared: any choice's progress wakes the answer
        scheduler = self.scheduler
        for req in reqs:
            req.share_event(changed)
            scheduler.submit(req)

        def abort_all() -> None:
            for req in reqs:
                scheduler.abort(req)

        responder.on_disconnect = abort_all
        return reqs

    def _total_usage(self, reqs: list[SimRequest], n: int) -> dict[str, Any]:
        """Usage over all choices, as SGLang's usage_processor.py sums it
        (`calculate_response_usage`, `calculate_streaming_usage`): completion tokens of every
        choice, prompt (and cached) tokens once per prompt (the first of its n choices)."""
        firsts = reqs[::n]
        prompt = sum(r.prompt_tokens for r in firsts)
        completion = sum(r.completion_tokens for r in reqs)
        cached = sum(r.cached_tokens for r in firsts)
        details = {"cached_tokens": cached} if self.config.enable_cache_report and cached else None
        return {
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion,
            "completion_tokens": completion,
            "prompt_tokens_details": details,
            "reasoning_tokens": 0,
        }

    async def _many_choices(
        self, request: HttpRequest, responder: Responder, params: GenParams, *, chat: bool
    ) -> None:
        """An answer with several choices (serving_chat.py `_generate_chat_stream`,
        `_build_chat_response`; serving_completions.py `_generate_completion_stream`,
        `_build_completion_response`). Whole: the choices by index, `id` the first choice's rid.
        Streamed: each chunk holds one choice, with that choice's rid as `id`; chunks of
        different choices interleave as their tokens come. A chat choice opens with its role
        chunk; its finish chunk comes only after every choice is done (in the order they
        finished, `id` the rid of the last choice that produced output); a completion choice's
        finish rides on its last content chunk. Then the usage chunk (summed) and `[DONE]`."""
        reqs = self._submit_choices(params, responder)
        changed = reqs[0]
        timing = self._timing(request, reqs[0], responder)
        model = params.model or DEFAULT_MODEL
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"
        if not params.stream:
            while not all(r.finished for r in reqs):
                await changed.wait_change()
            if responder.disconnected:
                return
            for req in reqs:
                message = self._abort_message(req)
                if message is not None:
                    await responder.send(400, openai_error(message))
                    return
            choices: list[dict[str, Any]] = []
            for index, req in enumerate(reqs):
                reason, matched = self._finish_fields(req)
                choice: dict[str, Any] = {"index": index}
                if chat:
                    choice["message"] = {"role": "assistant", "content": req.text(),
                                         "reasoning_content": None, "tool_calls": None}  # fmt: skip
                else:
                    choice["text"] = req.text()
                choice.update(logprobs=None, finish_reason=reason, matched_stop=matched)
                choices.append(choice)
            body = {
                "id": reqs[0].rid,
                "object": kind,
                "created": created,
                "model": model,
                "choices": choices,
                "usage": self._total_usage(reqs, params.n),
                "metadata": {"weight_version": self.config.model_version},
            }
            await responder.send(200, dumps(body))
            if timing is not None and any(r.text() for r in reqs):
                timing.first_token_at = time.perf_counter()
            return
        # The 200 goes with the first output (of any choice), so an early error is a 400.
        while not any(r.completion_tokens or r.finished for r in reqs):
            await changed.wait_change()
        if responder.disconnected:
            return
        first = next(r for r in reqs if r.completion_tokens or r.finished)
        message = self._abort_message(first)
        if message is not None and first.completion_tokens == 0:
            await responder.send(400, openai_error(message))
            return
        await responder.start(200, SSE_HEADERS)
        kind += ".chunk" if chat else ""
        sent_tokens = [0] * len(reqs)
        sent_chars = [0] * len(reqs)
        opened = [False] * len(reqs)
        finished: list[int] = []  # indexes, in the order their choices finished
        last_rid = first.rid
        while not responder.disconnected:
            for index, req in enumerate(reqs):
                if index in finished or not (
                    req.completion_tokens > sent_tokens[index] or req.finished
                ):
                    continue
                sent_tokens[index] = req.completion_tokens
                last_rid = req.rid
                message = self._abort_message(req)
                if message is not None:  # an error ends the whole answer
                    error = {"message": message, "type": "Bad Request", "param": None,
                             "code": 400}  # fmt: skip
                    await responder.write(sse({"error": error}))
                    await responder.write(DONE)
                    await responder.end()
                    return
                text = req.text()
                delta, sent_chars[index] = text[sent_chars[index] :], len(text)
                reason, matched = self._finish_fields(req)
                head = {"id": req.rid, "object": kind, "created": created, "model": model}
                outs: list[dict[str, Any]] = []
                if chat:
                    if not opened[index]:
                        role = {"reasoning_content": None, "role": "assistant", "content": ""}
                        outs.append({"index": index, "delta": role})
                    if delta:
                        content = {"reasoning_content": None, "content": delta}
                        outs.append({"index": index, "delta": content})
                    for out in outs:
                        out.update(logprobs=None, finish_reason=None, matched_stop=None)
                elif delta or reason is not None:
                    outs.append({"index": index, "text": delta, "logprobs": None,
                                 "finish_reason": reason, "matched_stop": matched})  # fmt: skip
                opened[index] = True
                for out in outs:
                    chunk: dict[str, Any] = {**head, "choices": [out]}
                    if not chat:
                        chunk["usage"] = None
                    if params.continuous_usage_stats:
                        chunk["usage"] = self._usage(req)
                    await responder.write(sse(chunk))
                if timing is not None and delta:  # the first content, stamped once
                    timing.first_token_at = time.perf_counter()
                    timing = None
                if req.finished:
                    finished.append(index)
            if len(finished) == len(reqs):
                break
            await changed.wait_change()
        else:
            return
        head = {"id": last_rid, "object": kind, "created": created, "model": model}
        if chat:
            empty = {"role": None, "content": None, "reasoning_content": None, "tool_calls": None}
            for index in finished:
                reason, matched = self._finish_fields(reqs[index])
                out = {"index": index, "delta": empty, "logprobs": None,
                       "finish_reason": reason, "matched_stop": matched}  # fmt: skip
                await responder.write(sse({**head, "choices": [out]}))
        if params.include_usage:
            usage = self._total_usage(reqs, params.n)
            if not chat:
                usage = {k: v for k, v in usage.items() if v is not None}
            await responder.write(sse({**head, "choices": [], "usage": usage}))
        await responder.write(DONE)
        await responder.end()

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
