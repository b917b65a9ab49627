"""Continuous batching with prefill priority, after SGLang's scheduler.

Theory of operation. One loop runs forever. Each turn it first tries to form a *prefill batch*
from the FCFS waiting queue (a prompt being prefilled in chunks goes first); if it gets one, it
runs it, and every request whose whole prompt is now computed gets its first token (the
prefill forward pass samples it) and joins the running batch. Only when no prefill batch can
be formed does the loop run one *decode step*, which gives every running request one more
token. A step "runs" by sleeping for the time the profile gives it (times `time_scale`).

Admission (SGLang's PrefillAdder): a waiting request joins a prefill batch only if the running
batch is under `max_running_requests`, the batch's new tokens stay under `max_prefill_tokens`
(the first request may exceed it only as a chunk), and the KV pool can hold its uncached prompt
plus its `max_new_tokens`, after evicting unlocked radix leaves if needed. Prompts longer
than the chunk budget (`chunked_prefill_size`) are prefilled one chunk per batch. The head of
the queue blocks the rest (FCFS).

KV accounting: used = tokens in the radix tree + tokens requests hold outside it; a request's
prompt goes into the tree once prefilled (so concurrent requests can share it) and its
prompt + output when it finishes, when its lock on the tree is released.

Retraction (SGLang's `retract_decode`): with `new_token_ratio` set, admission reserves only that
share of each request's `max_new_tokens`, so running requests can outgrow the pool. Before each
decode step the scheduler checks that every running request has room for one more token; if not
(even after evicting unlocked cache), it retracts the running request with the fewest output
tokens (ties: the longest prompt), frees its KV and puts it back at the head of the queue, where
it is prefilled again (prompt and output so far) and continues. A request that cannot fit even
alone is aborted.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
from collections.abc import Callable
from typing import Any

from backends.sim.clock import Clock
from backends.sim.config import SimConfig
from backends.sim.radix import RadixCache
from backends.sim.request import SimRequest, State
from backends.sim.stats import Stats
from backends.sim.tokenizer import EOS_ID

log = logging.getLogger("backends.sim.scheduler")

# Catch up on a late wake-up only by this much; beyond it, restart from now.
_MAX_CATCH_UP = 0.010
_RESERVE_CAP = 4096
_GEN_WINDOW_S = 5


class Scheduler:
    def __init__(
        self,
        config: SimConfig,
        *,
        clock: Clock,
        stats: Stats | None = None,
        kv_events: Callable[[list[list[Any]]], None] | None = None,
    ) -> None:
        self.config = config
        self.profile = config.timing
        self.clock = clock
        self.stats = stats or Stats()
        self.cache = RadixCache(config.page_size, events=kv_events)
        self.max_running = config.effective_max_running_requests
        self.max_total_tokens = config.effective_max_total_tokens
        self.waiting: collections.deque[SimRequest] = collections.deque()
        self.running: list[SimRequest] = []
        self.chunked: SimRequest | None = None
        self.holding: set[SimRequest] = set()
        """Admitted requests (prefilling or decoding): they hold KV tokens and a radix lock."""
        self._by_rid: dict[str, SimRequest] = {}
        self._wakeup = asyncio.Event()
        self._horizon = 0.0
        # Generated tokens per whole second of the clock, for the last few seconds.
        self._gen_buckets: collections.deque[list[int]] = collections.deque()

    # -- public API ----------------------------------------------------------------------------

    def submit(self, req: SimRequest) -> None:
        if req.rid in self._by_rid:
            raise ValueError(f"duplicate request id {req.rid!r}")
        req.created_at = self.clock.now()
        req.state = State.WAITING
        self._by_rid[req.rid] = req
        self.waiting.append(req)
        self._wakeup.set()

    def get(self, rid: str) -> SimRequest | None:
        return self._by_rid.get(rid)

    def abort(
        self, req: SimRequest, message: str | None = None, status_code: int | None = None
    ) -> bool:
        """Stop a request wherever it is and free what it holds. False if already finished.

        Without a `status_code` the abort is SGLang's graceful one (`/abort_request`, a client
        gone: `FINISH_ABORT()`, "Aborted", or "Abort in waiting queue" for a queued request),
        which the routes answer as a finish with `finish_reason` "abort"; with one it is an
        error, which they answer as one (SGLang's tokenizer_manager.py
        `_handle_abort_finish_reason`)."""
        if req.finished:
            return False
        if message is None:
            message = "Abort in waiting queue" if req.state is State.WAITING else "Aborted"
        if req.state is State.WAITING:
            self.waiting.remove(req)
        else:
            if req is self.chunked:
                self.chunked = None
            if req in self.running:
                self.running.remove(req)
            self._release(req)
        if req.log_metrics:
            self.stats.num_aborted_requests_total += 1
        reason: dict[str, object] = {
            "type": "abort",
            "message": message,
            "status_code": status_code,
            "err_type": None,
        }
        self._finish(req, reason, cache=False)
        return True

    def abort_all(self) -> int:
        reqs = [*self.waiting, *self.holding]
        return sum(self.abort(r) for r in reqs)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.holding

    def flush_cache(self) -> bool:
        """Reset the radix cache; refused (False) while any request is queued or running."""
        if not self.idle:
            return False
        self.cache.reset()
        return True

    @property
    def num_running(self) -> int:
        return len(self.holding)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def used_tokens(self) -> int:
        return self.cache.total_size + sum(r.own_tokens for r in self.holding)

    @property
    def in_use_tokens(self) -> int:
        """KV tokens that cannot be freed now: locked cache paths and running requests' own.

        This is what SGLang reports as used (max_total - (available + evictable)): cached
        prefixes no request holds are evictable, so a full but idle cache reads as 0 usage.
        """
        return self.cache.protected_size + sum(r.own_tokens for r in self.holding)

    @property
    def token_usage(self) -> float:
        return min(1.0, self.in_use_tokens / self.max_total_tokens)

    def gen_throughput(self) -> float:
        """Generated tokens per second over the last few seconds (sglang:gen_throughput)."""
        now = self.clock.now()
        self._trim_gen_buckets(int(now))
        if not self._gen_buckets:
            return 0.0
        span = max(now - self._gen_buckets[0][0], 1.0)
        return sum(n for _, n in self._gen_buckets) / span

    def _trim_gen_buckets(self, second: int) -> None:
        while self._gen_buckets and second - self._gen_buckets[0][0] >= _GEN_WINDOW_S:
            self._gen_buckets.popleft()

    def _count_generated(self, now: float) -> None:
        second = int(now)
        buckets = self._gen_buckets
        if buckets and buckets[-1][0] == second:
            buckets[-1][1] += 1
        else:
            buckets.append([second, 1])
            self._trim_gen_buckets(second)

    # -- the loop ------------------------------------------------------------------------------

    async def run(self) -> None:
        while True:
            if self.idle:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            batch = self._form_prefill_batch()
            if batch:
                chunks = [(size, req.computed) for req, size in batch]
                await self._advance(self.profile.prefill_time(chunks))
                self._finish_prefill(batch)
            elif self.running:
                if self._make_decode_room():
                    context = sum(r.prompt_tokens + r.completion_tokens for r in self.running)
                    await self._advance(self.profile.decode_time(len(self.running), context))
                    self._decode_step()
            else:
                # Queued work that cannot be admitted although nothing runs: it never will.
                req = self.waiting[0]
                log.warning("request %s does not fit in the KV pool; aborting it", req.rid)
                self.abort(req, "The request does not fit in the KV cache pool.", 400)

    async def _advance(self, duration: float) -> None:
        now = self.clock.now()
        start = self._horizon if now - self._horizon < _MAX_CATCH_UP else now
        deadline = max(start, now - _MAX_CATCH_UP) + duration * self.config.time_scale
        await self.clock.sleep_until(deadline)
        self._horizon = deadline

    # -- prefill -------------------------------------------------------------------------------

    def _free_tokens(self) -> int:
        reserved = sum(r.reserved_tokens for r in self.holding)
        return self.max_total_tokens - self.used_tokens - reserved

    def _form_prefill_batch(self) -> list[tuple[SimRequest, int]]:
        """[(request, new tokens this batch computes for it)], or [] if nothing can run."""
        cfg = self.config
        rem_input = cfg.max_prefill_tokens
        rem_chunk = cfg.chunked_prefill_size
        batch: list[tuple[SimRequest, int]] = []
        if self.chunked is not None:
            req = self.chunked
            remaining = req.prompt_tokens - req.computed
            size = min(remaining, rem_chunk)
            batch.append((req, size))
            if size < remaining:
                return batch
            rem_input -= size
            rem_chunk -= size
        while self.waiting and rem_input > 0 and rem_chunk > 0:
            if len(self.holding) >= self.max_running:
                break
            req = self.waiting[0]
            if not self._admit(req, first=not batch, rem_input=rem_input):
                break
            self.waiting.popleft()
            extend = req.prompt_tokens - req.computed
            if extend <= rem_chunk:
                batch.append((req, extend))
                rem_input -= extend
                rem_chunk -= extend
                continue
            size = rem_chunk - rem_chunk % cfg.page_size or rem_chunk
            batch.append((req, size))
            self.chunked = req
            break
        return batch

    def _admit(self, req: SimRequest, *, first: bool, rem_input: int) -> bool:
        """Match the prefix, lock it and reserve KV room; False leaves the request queued."""
        if self.config.disable_radix_cache:
            prefix_len, node = 0, self.cache.root
        else:
            # At least one token is always recomputed to produce logits (SGLang caps at len-1).
            prefix_len, node = self.cache.match_prefix(req.input_ids[: req.prompt_tokens - 1])
        extend = req.prompt_tokens - prefix_len
        if extend > rem_input and not first:
            return False
        done = req.completion_tokens  # a retracted request recomputes its output's KV too
        # SGLang reserves decode room only up to clip_max_new_tokens_estimation (4096).
        reserve = min(
            req.max_new_tokens - done,
            _RESERVE_CAP,
            max(0, self.max_total_tokens - req.prompt_tokens - done),
        )
        if self.config.new_token_ratio is not None:
            reserve = math.ceil(reserve * self.config.new_token_ratio)
        self.cache.inc_lock(node)
        need = extend + done + reserve
        free = self._free_tokens()
        if free < need:
            free += self.cache.evict(need - free)
        if free < need:
            self.cache.dec_lock(node)
            return False
        req.node = node
        req.prefix_len = prefix_len
        req.cached_tokens = prefix_len
        req.computed = prefix_len
        req.own_tokens = extend + done
        req.reserved_tokens = reserve
        req.state = State.PREFILL
        self.holding.add(req)
        if req.admitted_at is not None:  # re-admitted after a retraction: counted once
            return True
        req.admitted_at = self.clock.now()
        if req.log_metrics:
            self.stats.queue_time.observe(req.admitted_at - req.created_at)
            self.stats.prompt_tokens_total += req.prompt_tokens
            self.stats.cached_tokens_total += prefix_len
        return True

    def _finish_prefill(self, batch: list[tuple[SimRequest, int]]) -> None:
        now = self.clock.now()
        new_tokens = cached = 0
        for req, size in batch:
            if req.finished:  # aborted while the batch ran
                continue
            if req.computed == req.cached_tokens:
                cached += req.cached_tokens
            new_tokens += size
            req.computed += size
            self._cache_prefix(req, req.computed)
            if req.computed < req.prompt_tokens:
                continue  # more chunks to go; still self.chunked
            if req is self.chunked:
                self.chunked = None
            req.state = State.RUNNING
            self.running.append(req)
            if req.max_new_tokens == 0:  # prefill only: nothing to sample
                req.first_token_at = now
                req.finish_reason = {"type": "length", "length": 0}
                continue
            if req.first_token_at is None:
                req.first_token_at = now
                if req.log_metrics:
                    self.stats.ttft.observe(now - req.created_at)
            self._emit_token(req, now)
        if new_tokens + cached:
            self.stats.last_cache_hit_rate = cached / (new_tokens + cached)
        self._sweep_finished()

    def _cache_prefix(self, req: SimRequest, length: int) -> None:
        """Put the first `length` tokens of the request (prompt, then output) in the tree."""
        if self.config.disable_radix_cache:
            return
        key = (
            req.input_ids[:length]
            if length <= req.prompt_tokens
            else req.input_ids + req.output_ids
        )
        _, node = self.cache.insert(key[:length])
        aligned = length - length % self.cache.page_size
        if aligned <= req.prefix_len:
            return
        # The tree now owns tokens [prefix_len, aligned): duplicates of what another request
        # inserted meanwhile are simply freed.
        req.own_tokens -= aligned - req.prefix_len
        self.cache.inc_lock(node)
        assert req.node is not None
        self.cache.dec_lock(req.node)
        req.node = node
        req.prefix_len = aligned

    # -- decode --------------------------------------------------------------------------------

    def _make_decode_room(self) -> bool:
        """Room for one more token per running request, retracting some if needed; False when
        nothing is left to decode."""
        need = sum(1 for r in self.running if r.reserved_tokens == 0)
        while True:
            free = self._free_tokens()
            if free < need:
                free += self.cache.evict(need - free)
            if free >= need:
                return bool(self.running)
            if len(self.running) == 1:
                req = self.running[0]
                log.warning("request %s outgrew the whole KV pool; aborting it", req.rid)
                self.abort(req, "The request does not fit in the KV cache pool.", 400)
                return False
            # SGLang keeps the requests with the most output (and, on ties, shorter prompts)
            victim = min(self.running, key=lambda r: (r.completion_tokens, -r.prompt_tokens))
            need -= victim.reserved_tokens == 0
            self._retract(victim)

    def _retract(self, req: SimRequest) -> None:
        """Free a running request's KV and queue it again at the head (its output is kept)."""
        self.running.remove(req)
        self._release(req)
        req.state = State.WAITING
        req.computed = 0
        req.prefix_len = 0
        req.retractions += 1
        self.stats.num_retracted_reqs_total += 1
        self.waiting.appendleft(req)
        log.info("retracted request %s (KV pool full)", req.rid)

    def _decode_step(self) -> None:
        now = self.clock.now()
        for req in self.running:
            self._emit_token(req, now)
        self._sweep_finished()

    def _emit_token(self, req: SimRequest, now: float) -> None:
        index = len(req.output_ids)
        eos_allowed = not req.ignore_eos and index + 1 > req.min_new_tokens
        token_id, piece = req.plan.next_token(index, ignore_eos=not eos_allowed)
        req.output_ids.append(token_id)
        req.pieces.append(piece)
        req.own_tokens += 1
        if req.reserved_tokens:
            req.reserved_tokens -= 1
        if req.log_metrics:
            if req.last_token_at is not None:
                self.stats.itl.observe(now - req.last_token_at)
            self.stats.generation_tokens_total += 1
            self._count_generated(now)
        req.last_token_at = now
        req.finish_reason = self._check_finish(req, token_id, piece)
        req.notify()

    def _check_finish(self, req: SimRequest, token_id: int, piece: str) -> dict[str, object] | None:
        stop_allowed = len(req.output_ids) > req.min_new_tokens
        if stop_allowed and token_id == EOS_ID and not req.ignore_eos:
            return {"type": "stop", "matched": EOS_ID}
        if stop_allowed and token_id in req.stop_token_ids:
            return {"type": "stop", "matched": token_id}
        if stop_allowed and req.stop:
            req._tail = (req._tail + piece)[-256:]
            for stop in req.stop:
                at = req._tail.find(stop)
                if at >= 0:
                    if not req.no_stop_trim:
                        self._trim_stop(req, len(req._tail) - at)
                    return {"type": "stop", "matched": stop}
        if len(req.output_ids) >= req.max_new_tokens:
            return {"type": "length", "length": req.max_new_tokens}
        return None

    @staticmethod
    def _trim_stop(req: SimRequest, cut: int) -> None:
        """Drop the last `cut` characters of the text (the stop string and what follows)."""
        text = req.text()
        req.pieces = [text[: len(text) - cut]]

    def _sweep_finished(self) -> None:
        done = [r for r in self.running if r.finish_reason is not None]
        if not done:
            return
        self.running = [r for r in self.running if r.finish_reason is None]
        for req in done:
            self._cache_prefix(req, req.prompt_tokens + req.completion_tokens)
            self._release(req)
            self._finish(req, req.finish_reason, cache=True)

    def _release(self, req: SimRequest) -> None:
        self.holding.discard(req)
        if req.node is not None:
            self.cache.dec_lock(req.node)
            req.node = None
        req.own_tokens = 0
        req.reserved_tokens = 0

    def _finish(self, req: SimRequest, reason: dict[str, object] | None, *, cache: bool) -> None:
        now = self.clock.now()
        req.state = State.FINISHED
        req.finish_reason = reason
        req.finished_at = now
        self._by_rid.pop(req.rid, None)
        if cache and req.log_metrics:
            self.stats.num_requests_total += 1
            self.stats.e2e.observe(now - req.created_at)
        req.notify()
