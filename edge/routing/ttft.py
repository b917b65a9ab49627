"""`ttft` (the default): send each request where its predicted time to first token is smallest.

For each candidate backend the policy predicts

    TTFT = b + a * (Q + U) + c * U * (C + U/2) + d * D

  Q  prefill tokens queued ahead on that backend: the edge's own in-flight accounting (predicted
     uncached tokens of requests not yet past their first token), plus, when `/v1/loads` shows
     more waiting requests than the edge sent, the excess times the mean uncached size;
  U  this prompt's tokens that backend has not cached (from the prefix-tree match), C = the rest;
  D  requests decoding there (their steps interleave with prefill);
  b  fixed cost (scheduling, first decode step, network, the edge itself).

This is SGLang's prefill cost model (prefill-priority continuous batching: a request waits for
the prefill work queued before it, then pays for its own uncached tokens). The coefficients start
from priors for Llama-3-8B on an H100 and are learned online by recursive least squares with
forgetting from every observed TTFT, so the policy adapts to the real GPU, model and load. Each
hardware group (`Backend.hw_group`: h200, a100 ...) has its own coefficients, learned from its
own backends' TTFTs, so a fast and a slow GPU are not priced alike; a group starts from the priors.

The tree is corrected from what backends report: when a backend reports fewer cached tokens
than predicted, it has evicted. The policy trims that backend's tree below the point the backend
really held (an engine evicts leaves first, so nothing deeper survived) and shrinks its estimate
of that backend's cache size, evicting its least recently used entries. Backends that report
as much as predicted let the estimate grow back.

With a shared fleet view attached (`attach`), a backend the tree has no match for is looked up
there (the blocks other edge processes placed on it), and the in-flight prefill work other
processes report counts as queued; such a remote match is a hint, never used to trim the tree.
While other processes are heard from, a local match is believed only as far as the view still
holds its blocks: the tree sees this process's traffic only, the view the whole fleet's.
With a hot-prefix tracker attached, every routed prompt is counted there.

A session key is only a tie-breaker: the session's previous backend wins if its score (the
prediction with the miss charge) is within `session_slack` (relative) + `session_slack_s` of the
best one's, so load always wins.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from operator import mul
from typing import Any

import xxhash

from backends.registry import Backend
from edge.routing.base import Decision, Outcome, RequestView, register_policy, usable
from edge.routing.cache_aware import chars_to_tokens
from edge.routing.fleet_view import FleetView
from edge.routing.hot_prefixes import HotPrefixes, model_of
from edge.routing.prefix_blocks import BlockHasher, PrefixBlocks
from edge.routing.prefix_tree import DEFAULT_MAX_CHARS, PrefixTree
from edge.stages.view import render_chat

# Feature scaling keeps the least-squares problem well conditioned: seconds per 1k tokens,
# per 1M token-pairs, per 10 decoding requests.
_SCALES = (1.0, 1e-3, 1e-6, 0.1)
# Priors from public figures for Llama-3.1-8B BF16 on one H100 (about 30k prefill tokens/s at
# 40-60 % MFU): b 15 ms, a 33 us/token,
# c 1 ns/token-pair, d 1 ms per 10 decoding requests.
PRIOR = (0.015, 0.033, 0.001, 0.001)


def default_bounds(prior: Sequence[float]) -> list[tuple[float, float]]:
    """Physically plausible ranges: `a` within 10x of its prior (it must stay positive, or
    cached tokens would stop mattering), c and d at most 10x theirs, b anything up to 2 s.
    Bounds keep a burst of queueing outliers from teaching the model nonsense."""
    b, a, c, d = prior
    return [(0.0, 2.0), (a / 10, a * 10), (0.0, max(c, 1e-3) * 10), (0.0, max(d, 1e-3) * 10)]


class RecursiveLeastSquares:
    """Online linear regression y ~ theta . x with exponential forgetting (lambda)."""

    def __init__(
        self,
        prior: Sequence[float],
        *,
        forgetting: float,
        prior_scale: float,
        noise_s: float,
        bounds: Sequence[tuple[float, float]] | None = None,
    ) -> None:
        """`prior_scale`: prior standard deviation relative to each prior coefficient;
        `noise_s`: expected TTFT noise (s). Their ratio sets how fast data overrides priors.
        `bounds`: (low, high) per coefficient; the estimate is projected into them."""
        if not 0.5 < forgetting <= 1:
            raise ValueError("forgetting must be in (0.5, 1]")
        if prior_scale <= 0 or noise_s <= 0:
            raise ValueError("prior_scale and noise_s must be > 0")
        n = len(prior)
        self.theta = list(prior)
        self.forgetting = forgetting
        self._p = [[0.0] * n for _ in range(n)]
        for i, value in enumerate(prior):
            self._p[i][i] = (prior_scale * max(abs(value), 1e-3) / noise_s) ** 2
        self._max_trace = sum(self._p[i][i] for i in range(n)) * 100
        self.bounds = list(bounds) if bounds is not None else [(-math.inf, math.inf)] * n
        self._abs_err = noise_s  # running mean absolute residual, for clipping outliers
        self.updates = 0

    def predict(self, x: Sequence[float]) -> float:
        if len(x) != len(self.theta):
            raise ValueError(f"expected {len(self.theta)} features, got {len(x)}")
        return sum(map(mul, self.theta, x))

    def update(self, x: Sequence[float], y: float) -> None:
        if len(self.theta) == 4:
            self._update4(x, y)
        else:
            self._update_any(x, y)

    def _update_any(self, x: Sequence[float], y: float) -> None:
        # Row by row with map(): index loops over the small matrix cost several times as much
        # in the interpreter.
        p = self._p
        px = [sum(map(mul, row, x)) for row in p]
        denom = self.forgetting + sum(map(mul, x, px))
        if denom <= 0:
            return
        k = [v / denom for v in px]
        err = self._clipped(y - self.predict(x))
        self.theta = [
            max(low, min(high, t + ki * err))
            for t, ki, (low, high) in zip(self.theta, k, self.bounds, strict=True)
        ]
        lam = self.forgetting
        p = [
            [(pij - ki * pxj) / lam for pij, pxj in zip(row, px, strict=True)]
            for row, ki in zip(p, k, strict=True)
        ]
        trace = sum(row[i] for i, row in enumerate(p))
        if trace > self._max_trace:  # no excitation + forgetting blows P up ("windup")
            f = self._max_trace / trace
            p = [[v * f for v in row] for row in p]
        self._p = p
        self.updates += 1

    def _update4(self, x: Sequence[float], y: float) -> None:
        """`update` written out for the `ttft` policy's four features. It runs after every
        response, and the general form's nested comprehensions cost ~95k instructions of the
        ~780k a whole request takes (`tools.request_cpu`). The same operations in the same
        order as `_update_any`, so the same results (tested)."""
        x0, x1, x2, x3 = x
        (p00, p01, p02, p03), (p10, p11, p12, p13), (p20, p21, p22, p23), (p30, p31, p32, p33) = (
            self._p
        )
        px0 = p00 * x0 + p01 * x1 + p02 * x2 + p03 * x3
        px1 = p10 * x0 + p11 * x1 + p12 * x2 + p13 * x3
        px2 = p20 * x0 + p21 * x1 + p22 * x2 + p23 * x3
        px3 = p30 * x0 + p31 * x1 + p32 * x2 + p33 * x3
        lam = self.forgetting
        denom = lam + (x0 * px0 + x1 * px1 + x2 * px2 + x3 * px3)
        if denom <= 0:
            return
        k0, k1, k2, k3 = px0 / denom, px1 / denom, px2 / denom, px3 / denom
        t0, t1, t2, t3 = self.theta
        err = self._clipped(y - (t0 * x0 + t1 * x1 + t2 * x2 + t3 * x3))
        (lo0, hi0), (lo1, hi1), (lo2, hi2), (lo3, hi3) = self.bounds
        self.theta = [
            max(lo0, min(hi0, t0 + k0 * err)),
            max(lo1, min(hi1, t1 + k1 * err)),
            max(lo2, min(hi2, t2 + k2 * err)),
            max(lo3, min(hi3, t3 + k3 * err)),
        ]
        p = [
            [(p00 - k0 * px0) / lam, (p01 - k0 * px1) / lam, (p02 - k0 * px2) / lam,
             (p03 - k0 * px3) / lam],
            [(p10 - k1 * px0) / lam, (p11 - k1 * px1) / lam, (p12 - k1 * px2) / lam,
             (p13 - k1 * px3) / lam],
            [(p20 - k2 * px0) / lam, (p21 - k2 * px1) / lam, (p22 - k2 * px2) / lam,
             (p23 - k2 * px3) / lam],
            [(p30 - k3 * px0) / lam, (p31 - k3 * px1) / lam, (p32 - k3 * px2) / lam,
             (p33 - k3 * px3) / lam],
        ]  # fmt: skip
        trace = p[0][0] + p[1][1] + p[2][2] + p[3][3]
        if trace > self._max_trace:  # no excitation + forgetting blows P up ("windup")
            f = self._max_trace / trace
            p = [[v * f for v in row] for row in p]
        self._p = p
        self.updates += 1

    def _clipped(self, err: float) -> float:
        """Huber-style clipping: one request stuck behind a burst must not swing the model."""
        limit = 4 * self._abs_err
        self._abs_err += 0.05 * (min(abs(err), limit) - self._abs_err)
        return max(-limit, min(limit, err))


_SESSION_KEY_CHARS = 64


def session_id(key: str) -> str:
    """What the session map keeps of a session key: the key itself, or a 128-bit hash of a
    long one (a body's `prompt_cache_key` or `user` may be megabytes long, and the map keeps
    up to `max_sessions` of them)."""
    if len(key) <= _SESSION_KEY_CHARS:
        return key
    return "#" + xxhash.xxh3_128_hexdigest(key.encode("utf-8", "surrogatepass"))


def _opaque(part: Any) -> bool:
    """A content part the routing view leaves out (an image, audio: no text of its own)."""
    return not (isinstance(part, dict) and isinstance(part.get("text"), str))


def opaque_at(view: RequestView) -> int | None:
    """Where in a chat request's routing text its first content part that is not text (an
    image, audio) sits; None if it has none. The view renders text only, so requests that
    differ in such a part alone share their text past it, which a backend's cache does not."""
    messages = view.messages
    if messages is None:
        return None
    found = next(
        (
            i
            for i, m in enumerate(messages)  # (text-only conversations: no rendering)
            if isinstance(m.get("content"), list) and any(map(_opaque, m["content"]))
        ),
        None,
    )
    if found is None:
        return None
    m = messages[found]
    pos = view.prompt_start + len(render_chat(messages[:found])) - _ASSISTANT_MARK
    pos += len(f"<|{m['role']}|>\n")
    for part in m["content"]:
        if _opaque(part):
            break
        pos += len(part["text"])
    return pos


_ASSISTANT_MARK = len(render_chat([]))
"""The assistant marker `render_chat` ends with."""


@register_policy("ttft")
class TTFTPolicy:
    name = "ttft"

    def __init__(
        self,
        *,
        max_tree_chars: int = DEFAULT_MAX_CHARS,
        learn: bool = True,
        forgetting: float = 0.995,
        prior: Sequence[float] = PRIOR,
        prior_scale: float = 1.0,
        noise_s: float = 0.01,
        session_slack: float = 0.1,
        session_slack_s: float = 0.002,
        miss_penalty: float = 0.5,
        max_sessions: int = 65536,
        capacity_fraction: float = 0.9,
        learn_completions: bool = True,
    ) -> None:
        if len(prior) != 4:
            raise ValueError("prior must have 4 coefficients: b, a, c, d")
        if session_slack < 0 or session_slack_s < 0:
            raise ValueError("session slack must be >= 0")
        if miss_penalty < 0:
            raise ValueError("miss_penalty must be >= 0")
        if not 0 < capacity_fraction <= 1:
            raise ValueError("capacity_fraction must be in (0, 1]")
        if max_sessions < 1:
            raise ValueError("max_sessions must be >= 1")
        self.tree = PrefixTree(max_tree_chars)
        self._rls_options = {
            "forgetting": forgetting, "prior_scale": prior_scale, "noise_s": noise_s,
            "bounds": default_bounds(prior),
        }  # fmt: skip
        self._prior = tuple(prior)
        self.model = RecursiveLeastSquares(self._prior, **self._rls_options)  # type: ignore[arg-type]
        """The coefficients of hardware group `default` (the only one of a uniform fleet)."""
        self.groups: dict[str, RecursiveLeastSquares] = {"default": self.model}
        """Coefficients per hardware group."""
        self.learn = learn
        self.session_slack = session_slack
        self.session_slack_s = session_slack_s
        self.miss_penalty = miss_penalty
        self.max_sessions = max_sessions
        self.capacity_fraction = capacity_fraction
        self.learn_completions = learn_completions
        self._sessions: OrderedDict[str, str] = OrderedDict()
        self._open: dict[int, None] = {}  # stamps of routed requests not yet observed
        self._turn = 0
        self._mean_uncached = 512.0
        self._tokens_per_char = 0.25
        self._capacity_cap: dict[str, int] = {}
        self.trims = 0
        self._hasher: BlockHasher | None = None
        self.hot: HotPrefixes | None = None
        self.fleet: FleetView | None = None

    def attach(
        self, hasher: BlockHasher, *, hot: HotPrefixes | None = None, fleet: FleetView | None = None
    ) -> None:
        """Count routed prompts in `hot` and consult / feed the shared `fleet` view."""
        self._hasher = hasher if hot is not None or fleet is not None else None
        self.hot = hot
        self.fleet = fleet

    def forget(self, url: str) -> None:
        """The backend lost its cache (it restarted): drop what the tree says it holds."""
        self.tree.remove_tenant(url)
        if self.fleet is not None:
            self.fleet.forget(url)

    def holds(self, url: str, text: str) -> None:
        """The backend has this text cached now (it was warmed with it)."""
        self.tree.insert(text, url)

    def learned(self) -> tuple[list[float], int]:
        """The model's raw coefficients and how many responses taught them (for the fleet)."""
        return list(self.model.theta), self.model.updates

    def adopt(self, theta: list[float]) -> None:
        """Take coefficients learned elsewhere, within this model's bounds."""
        if len(theta) == len(self.model.theta):
            self.model.theta = [
                max(low, min(high, t))
                for t, (low, high) in zip(theta, self.model.bounds, strict=True)
            ]

    # -- prediction ------------------------------------------------------------------------
    def coefficients(self, group: str = "default") -> tuple[float, ...]:
        """(b s, a s/token, c s/token-pair, d s/decoding request) of a hardware group, as used in
        predictions."""
        theta = self.group_model(group).theta
        return tuple(t * s for t, s in zip(theta, _SCALES, strict=True))

    def group_model(self, group: str) -> RecursiveLeastSquares:
        """The coefficients of one hardware group, from the priors the first time it is seen."""
        model = self.groups.get(group)
        if model is None:
            model = self.groups[group] = RecursiveLeastSquares(
                self._prior,
                **self._rls_options,  # type: ignore[arg-type]
            )
        return model

    def features(self, backend: Backend, cached: int, view: RequestView) -> list[float]:
        uncached = max(0, view.approx_tokens - cached)
        queued = float(backend.in_flight_prefill_tokens)
        decoding = backend.in_flight - backend.in_prefill
        remote = 0
        fleet = self.fleet
        if fleet is not None and fleet.processes > 1:
            # The other edge processes' requests there, as they published them a load interval
            # ago at most: the queue and the decoding batch are the whole fleet's.
            tokens, remote, flying = fleet.queued(backend.url)
            queued += tokens
            decoding += flying - remote
        load = backend.load
        if load is not None:
            extra = load.num_waiting_reqs - backend.in_prefill - remote
            if extra > 0:  # work the edge did not send (another edge, a direct client)
                queued += extra * self._mean_uncached
            decoding = max(decoding, load.num_running_reqs - backend.in_prefill)
        raw = (1.0, queued + uncached, uncached * (cached + uncached / 2), float(max(0, decoding)))
        return [v * s for v, s in zip(raw, _SCALES, strict=True)]

    def _predict(self, x: Sequence[float], group: str = "default") -> float:
        return self.group_model(group).predict(x)

    def choose(self, view: RequestView, candidates: Sequence[Backend]) -> Decision:
        pool = usable(candidates)
        match = self.tree.match(view.text)
        hashes: tuple[int, ...] = ()
        block_chars = 0
        if self._hasher is not None:
            blocks: PrefixBlocks = self._hasher.blocks(view.text)
            hashes, block_chars = blocks.hashes, blocks.block_chars
            if self.hot is not None:
                model = model_of(view.model, pool)
                self.hot.record(model, blocks, view.messages, view.tools, token_ids=view.token_ids)
        fleet = self.fleet if hashes else None
        remote_hit = False
        self._turn += 1
        n = len(pool)
        best: tuple[float, int, int, int] | None = None
        best_i = 0
        scored: list[tuple[float, int, list[float], int, float]] = []
        # Past an image, the text the tree matched is no evidence: the image may differ.
        opaque = opaque_at(view)
        shared = self.fleet
        if shared is not None and shared.processes > 1:  # the whole fleet's requests there
            flights = [b.in_flight + shared.queued(b.url)[2] for b in pool]
        else:
            flights = [b.in_flight for b in pool]
        mean_in_flight = sum(flights) / n + 1
        for i, b in enumerate(pool):
            self._learn_capacity(b)
            chars = match.chars.get(b.url, 0)
            if fleet is not None:
                if chars < block_chars:
                    depth = fleet.depth(b.url, hashes)
                    if depth:  # placed there by another process (or past this tree's bound)
                        chars = depth * block_chars
                        remote_hit = True
                elif fleet.processes > 1:
                    # This tree sees this process's traffic only, so it keeps prefixes that
                    # the whole fleet's placements have pushed out of the backend since.
                    depth = fleet.depth(b.url, hashes)
                    if depth < len(hashes) and depth + 1 < chars // block_chars:
                        chars = depth * block_chars
            if opaque is not None:
                chars = min(chars, opaque)
            cached = chars_to_tokens(chars, view)
            x = self.features(b, cached, view)
            rls = self.groups.get(b.hw_group) or self.group_model(b.hw_group)
            pred = rls.predict(x)
            # The choice also charges part of this request's own prefill to the requests that
            # will queue behind it there (a cache miss delays them all): `miss_penalty`, times
            # how many arrive there relative to elsewhere (Little's law: in-flight ~ rate).
            uncached = max(0, view.approx_tokens - cached) * _SCALES[1]
            behind = (flights[i] + 1) / mean_in_flight
            score = pred + self.miss_penalty * rls.theta[1] * uncached * behind
            scored.append((score, cached, x, chars, pred))
            # Ties (an idle fleet, nothing cached) rotate, so they spread like least_load.
            key = (score, -cached, flights[i], (i - self._turn) % n)
            if best is None or key < best:
                best, best_i = key, i
        reason = "ttft"
        session = None if view.session_key is None else session_id(view.session_key)
        if session is not None:
            url = self._sessions.get(session)
            if url is not None and url != pool[best_i].url:
                for i, b in enumerate(pool):
                    if b.url == url:
                        limit = scored[best_i][0] * (1 + self.session_slack) + self.session_slack_s
                        if scored[i][0] <= limit:
                            best_i, reason = i, "session"
                        break
        backend = pool[best_i]
        _, cached, x, chars, pred = scored[best_i]
        # A match that rests on an insert whose request is still in flight is not yet in the
        # backend's cache (it may still be queued): a shortfall then is no sign of eviction.
        confirmed = match.stamps.get(backend.url, 0) not in self._open
        if remote_hit and chars != match.chars.get(backend.url, 0):
            confirmed = False  # a hint from the fleet is not this process's knowledge
        if opaque is not None:
            # Its report counts the image's tokens, which its text cannot be converted with.
            confirmed = False
        stamp = self.tree.insert(view.text, backend.url)
        if fleet is not None:
            fleet.placed(backend.url, hashes)
        self._open[stamp] = None
        while len(self._open) > self.max_sessions:  # observe() never came for the oldest
            del self._open[next(iter(self._open))]
        if session is not None:
            self._remember_session(session, backend.url)
        uncached = view.approx_tokens - cached
        self._mean_uncached += 0.05 * (uncached - self._mean_uncached)
        return Decision(
            backend=backend,
            reason=reason,
            predicted_cached_tokens=cached,
            predicted_ttft_s=pred,
            features=(*x, float(chars), float(stamp), 1.0 if confirmed else 0.0),
        )

    def _remember_session(self, key: str, url: str) -> None:
        self._sessions[key] = url
        self._sessions.move_to_end(key)
        while len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)

    def _learn_capacity(self, backend: Backend) -> None:
        """Bound the tenant's tree by the backend's KV pool once `/v1/loads` tells its size."""
        load = backend.load
        if load is None or not load.max_total_tokens:
            return
        cap = int(load.max_total_tokens / self._tokens_per_char * self.capacity_fraction)
        old = self._capacity_cap.get(backend.url)
        if old is not None and abs(cap - old) <= 0.1 * old:
            return
        self._capacity_cap[backend.url] = cap
        if self.fleet is not None and self._hasher is not None:
            self.fleet.set_capacity(backend.url, cap // self._hasher.block_chars)
        limit = self.tree.limit(backend.url)
        if limit is None or old is None or limit >= old or limit > cap:
            self.tree.set_limit(backend.url, cap)  # follow the cap unless feedback lowered it

    # -- learning --------------------------------------------------------------------------
    def observe(self, outcome: Outcome) -> None:
        url = outcome.backend.url
        view = outcome.view
        features = outcome.decision.features
        if features is not None:
            self._open.pop(int(features[5]), None)
        if outcome.error is not None:
            if outcome.error == "connect":
                self.tree.remove_tenant(url)  # a backend that is down restarts with no cache
            return
        if self.learn and features is not None and outcome.ttft_s is not None:
            self.group_model(outcome.backend.hw_group).update(features[:4], outcome.ttft_s)
        # (a report that counts an image's tokens does not convert the text's)
        if outcome.prompt_tokens and view.text and opaque_at(view) is None:
            ratio = outcome.prompt_tokens / len(view.text)
            self._tokens_per_char += 0.05 * (ratio - self._tokens_per_char)
        confirmed = features is not None and features[6] > 0
        if confirmed and outcome.cached_tokens is not None and view.text:
            assert features is not None
            self._correct_cache(outcome, matched_chars=int(features[4]))
        if self.learn_completions and outcome.completion_text:
            self.tree.insert(view.text + outcome.completion_text, url)

    def _correct_cache(self, outcome: Outcome, *, matched_chars: int) -> None:
        view = outcome.view
        url = outcome.backend.url
        reported = outcome.cached_tokens or 0
        # Convert with the backend's own token count when it reported one (exact ratio).
        tokens = outcome.prompt_tokens or view.approx_tokens
        per_char = tokens / len(view.text)
        predicted = min(int(matched_chars * per_char), tokens - 1)
        missing = predicted - reported
        if missing > max(16, 0.1 * predicted):
            keep_chars = int(reported / per_char)
            self.tree.trim(view.text, url, keep_chars)
            self.tree.insert(view.text, url)  # it holds this prompt again now
            held = self.tree.tenant_chars(url)
            limit = self.tree.limit(url)
            if limit is None:
                limit = held
            floor = max(len(view.text), 1024)  # room for this prompt at least
            self.tree.set_limit(url, max(floor, min(limit, held) - int(missing / per_char)))
            self.trims += 1
        elif missing <= 0:
            limit = self.tree.limit(url)
            cap = self._capacity_cap.get(url)
            if limit is not None:
                grown = int(limit * 1.02) + int(-missing / per_char)
                self.tree.set_limit(url, grown if cap is None else min(cap, grown))


__all__ = ["PRIOR", "RecursiveLeastSquares", "TTFTPolicy"]
