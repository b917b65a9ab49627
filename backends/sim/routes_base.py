"""What every route handler shares: server state, wire helpers, and turning parsed
parameters into a scheduler request.

Native routes answer errors as `{"error": {"message": ...}}`; OpenAI routes as
`{"object": "error", "message": ..., "type": "Bad Request", "param": null, "code": 400}`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from backends.sim.config import SimConfig
from backends.sim.guard import Guard
from backends.sim.http import HttpRequest, Responder
from backends.sim.logprobs import LogprobSource
from backends.sim.metrics import SimMetrics
from backends.sim.request import SimRequest
from backends.sim.scheduler import Scheduler
from backends.sim.textgen import OutputPlan, TokenPlan
from backends.sim.tokenizer import Tokenizer
from backends.sim.wire import BadRequest, GenParams

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


@dataclass(slots=True)
class Timing:
    """One generation request's `perf_counter()` stamps (`--record-timings`), which a
    benchmark on the same host joins by rid (or by the `x-request-id` a proxy in front
    sends) with its own stamps to split the latency."""

    rid: str
    read_at: float
    """The socket read that completed the request."""
    first_token_at: float | None = None
    """Just after the first non-empty text (a whole non-streamed answer) went to the
    transport; None when no content was sent (an error, an abort, a client gone)."""


class RouteContext:
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
        self.timings: deque[Timing] | None = (
            deque(maxlen=config.record_timings) if config.record_timings else None
        )
        self.guard = Guard(config.guard_unsafe) if config.guard else None
        """Guard mode's classifier (chat completions answer a verdict); None: a plain model."""

    def _new_request(
        self, params: GenParams, plan: TokenPlan | None = None, sample: int = 0
    ) -> SimRequest:
        """`sample`: which of a prompt's `n` choices this is; each draws its own answer (the
        first the one `n` = 1 gives)."""
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
        cfg = self.config
        lo, hi = cfg.natural_output_len
        if plan is None:
            plan = OutputPlan(
                self.tokenizer,
                params.input_ids,
                # `text`: another stream for the same prompt; `long`: answers twice as long
                seed=(cfg.seed ^ 0x5EED if cfg.variant == "text" else cfg.seed) + 7919 * sample,
                natural_len=(2 * lo, 2 * hi) if cfg.variant == "long" else (lo, hi),
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

    def _logprobs(self, params: GenParams) -> LogprobSource | None:
        """The answer's logprobs when the request asked for them."""
        if not params.logprobs:
            return None
        cfg = self.config
        return LogprobSource(cfg.seed, cfg.variant, params.input_ids, params.top_logprobs)

    def _pieces(self, req: SimRequest) -> list[str]:
        """One text piece per output token (a trimmed stop string merges the pieces)."""
        if len(req.pieces) == len(req.output_ids):
            return req.pieces
        return [self.tokenizer.decode([i]) for i in req.output_ids]

    def _submit(
        self, params: GenParams, responder: Responder, plan: TokenPlan | None = None
    ) -> SimRequest:
        req = self._new_request(params, plan)
        self.scheduler.submit(req)
        scheduler = self.scheduler
        # A client that goes away aborts its request and frees its slot (SGLang's abort task).
        responder.on_disconnect = lambda: scheduler.abort(req)
        return req

    def _submit_batch(self, batch: list[GenParams], responder: Responder) -> list[SimRequest]:
        """A batch's requests, all checked before any is scheduled (a refused one refuses the
        batch, as SGLang's tokenizer manager does); a client gone aborts them all."""
        reqs = [self._new_request(params) for params in batch]
        scheduler = self.scheduler
        for req in reqs:
            scheduler.submit(req)

        def abort_all() -> None:
            for req in reqs:
                scheduler.abort(req)

        responder.on_disconnect = abort_all
        return reqs

    def _timing(self, request: HttpRequest, req: SimRequest, responder: Responder) -> Timing | None:
        """The request's record, or None when not recording. It joins `timings` once the answer
        is done, so a listed record is final. A stream drops it once the first content is
        stamped: on or off, what each later chunk costs is one test of a local for None."""
        timings = self.timings
        if timings is None:
            return None
        # Keyed by the id a proxy in front labels the request with (its client's), which the
        # benchmark knows; the rid a proxy sends is its own.
        label = request.header(b"x-request-id")
        timing = Timing(label.decode("latin-1") if label else req.rid, request.read_at)
        responder.on_done = lambda: timings.append(timing)
        return timing

    @staticmethod
    async def _until_finished(req: SimRequest) -> None:
        while not req.finished:
            await req.wait_change()

    async def _whole_answer_due(
        self, req: SimRequest, responder: Responder, error: Callable[[str], bytes]
    ) -> bool:
        """Wait for a non-streamed request to finish; False when there is no answer to send:
        the client went away, or the request ended in an error (a 400 went out, as SGLang's)."""
        await self._until_finished(req)
        if responder.disconnected:
            return False
        message = self._abort_message(req)
        if message is not None:
            await responder.send(400, error(message))
            return False
        return True

    @staticmethod
    def _abort_message(req: SimRequest) -> str | None:
        """The message of an abort that is an error (one with a status code), which the routes
        answer as an error; None otherwise. A graceful abort (`/abort_request`) is a finish like
        any other, with `finish_reason` "abort", as SGLang answers it."""
        reason = req.finish_reason
        if reason is not None and reason.get("type") == "abort" and reason.get("status_code"):
            return str(reason.get("message", "aborted"))
        return None
