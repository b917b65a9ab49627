"""`cache_aware`: SGLang router's cache-aware policy (sgl-router / SMG), reimplemented.

Per request: if the fleet is imbalanced — `max_load - min_load > balance_abs_threshold` and
`max_load > balance_rel_threshold * min_load`, load being the edge's in-flight count — the
least-loaded backend wins. Otherwise the request text is matched against the shared prefix tree;
if the best match covers more than `cache_threshold` of the text, the backend holding it wins
(the most recently used one among equals), else the least-loaded backend (the rule since
December 2025; the older "smallest tree" rule caused a death spiral). The chosen backend's tree
then gains the request text, and, once the response is in, the generated text too.

Defaults are sgl-router's CLI defaults since August 2025: 0.3, 64 and 1.5.
"""

from __future__ import annotations

from collections.abc import Sequence

from backends.registry import Backend
from edge.routing.base import Decision, Outcome, RequestView, register_policy, usable
from edge.routing.prefix_tree import DEFAULT_MAX_CHARS, PrefixTree


def chars_to_tokens(chars: int, view: RequestView) -> int:
    """Convert matched characters to tokens at this prompt's characters-per-token ratio."""
    if not view.text or chars <= 0:
        return 0
    cached = chars * view.approx_tokens // len(view.text)
    return max(0, min(cached, view.approx_tokens - 1))  # SGLang recomputes at least one token


@register_policy("cache_aware")
class CacheAware:
    name = "cache_aware"

    def __init__(
        self,
        *,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
        max_tree_chars: int = DEFAULT_MAX_CHARS,
        learn_completions: bool = True,
    ) -> None:
        if not 0 <= cache_threshold <= 1:
            raise ValueError("cache_threshold must be in [0, 1]")
        if balance_abs_threshold < 0 or balance_rel_threshold < 1:
            raise ValueError("balance_abs_threshold must be >= 0, balance_rel_threshold >= 1")
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.learn_completions = learn_completions
        self.tree = PrefixTree(max_tree_chars)
        self._processed: dict[str, int] = {}

    def _least_loaded(self, pool: Sequence[Backend]) -> Backend:
        return min(pool, key=lambda b: (b.in_flight, self._processed.get(b.url, 0)))

    def choose(self, view: RequestView, candidates: Sequence[Backend]) -> Decision:
        pool = usable(candidates)
        loads = [b.in_flight for b in pool]
        lo, hi = min(loads), max(loads)
        match = self.tree.match(view.text)
        if hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo:
            backend, reason = self._least_loaded(pool), "imbalanced"
        else:
            best: Backend | None = None
            best_key = (0, 0)
            for b in pool:
                key = (match.chars.get(b.url, 0), match.stamps.get(b.url, 0))
                if key > best_key:
                    best, best_key = b, key
            rate = best_key[0] / len(view.text) if view.text else 0.0
            if best is not None and rate > self.cache_threshold:
                backend, reason = best, "cache_hit"
            else:
                backend, reason = self._least_loaded(pool), "cache_miss"
        self._processed[backend.url] = self._processed.get(backend.url, 0) + 1
        self.tree.insert(view.text, backend.url)
        cached = chars_to_tokens(match.chars.get(backend.url, 0), view)
        return Decision(backend=backend, reason=reason, predicted_cached_tokens=cached)

    def observe(self, outcome: Outcome) -> None:
        if self.learn_completions and outcome.error is None and outcome.completion_text:
            self.tree.insert(outcome.view.text + outcome.completion_text, outcome.backend.url)


__all__ = ["CacheAware", "chars_to_tokens"]
