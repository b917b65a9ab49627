"""What a routing policy sees, what it decides, and what it learns afterwards.

A policy is synchronous and does no I/O: `choose` picks one backend from the candidates the
registry offers, and `observe` receives exactly one `Outcome` per routed attempt (TTFT, the
cached tokens the backend reported, the generated text, or the error), so the policy can learn.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from backends.registry import Backend

POLICY_NAMES: tuple[str, ...] = (
    "round_robin",
    "random",
    "least_load",
    "power_of_two",
    "cache_aware",
    "ttft",
)
DEFAULT_POLICY = "ttft"


@dataclass(slots=True)
class RequestView:
    """The parts of a request routing needs, extracted once by the app."""

    route: str
    """"/v1/chat/completions" | "/v1/completions" | "/generate"."""
    text: str
    """The prompt as the backend will see it (chat: messages rendered with role markers)."""
    approx_tokens: int
    """Estimate of the prompt's tokens."""
    session_key: str | None = None
    """x-session-id header or the body's "user" field."""
    model: str | None = None
    messages: list[dict[str, Any]] | None = None
    """Chat: the body's messages (not copied), which pre-warming sends back through the chat
    endpoint, so that the backend's own template renders them; None for other routes."""
    tools: list[Any] | None = None
    """Chat: the tools the request offers (not copied), rendered at the start of `text` and
    sent back with the messages by pre-warming; None without."""
    prompt_start: int = 0
    """Where the messages begin in `text` (after the tools' definitions)."""
    choices: int = 1
    """The answers asked for (`n`): with more than one, a stream interleaves them, so its
    text is not one continuation of the prompt to learn."""
    token_ids: bool = False
    """The prompt is token ids (`text` is them in decimal, joined by spaces): pre-warming sends
    its hot prefix back as ids, which the backend caches as such, not the digits' tokens."""
    batch_tokens: int | None = None
    """A batch of token-id prompts: the tokens of all of them, which admission charges (routing
    goes by the first, `text` and `approx_tokens`); None: one prompt, `approx_tokens`."""


@dataclass(slots=True)
class Decision:
    backend: Backend
    reason: str
    """Why this backend, in a word or two (for spans, logs and the benchmark)."""
    predicted_cached_tokens: int = 0
    predicted_ttft_s: float | None = None
    features: tuple[float, ...] | None = None
    """The policy's own record of what it predicted from; opaque to everyone else."""


@dataclass(slots=True)
class Outcome:
    backend: Backend
    view: RequestView
    decision: Decision
    ttft_s: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    """As reported by the backend (usage.prompt_tokens_details / meta_info)."""
    completion_text: str | None = None
    error: str | None = None
    """None on success, else a failure kind (connect, timeout, protocol, 5xx, disconnect ...)."""


class RoutingPolicy(Protocol):
    name: str

    def choose(self, view: RequestView, candidates: Sequence[Backend]) -> Decision:
        """Pick a backend; synchronous, no I/O. `candidates` must not be empty."""
        ...

    def observe(self, outcome: Outcome) -> None:
        """Learn from one finished (or failed) attempt."""
        ...


class NoCandidates(ValueError):
    """`choose` was called with no candidates (the app answers 503 before that happens)."""


def usable(candidates: Sequence[Backend]) -> Sequence[Backend]:
    """Non-degraded candidates if there are any, else all of them."""
    if not candidates:
        raise NoCandidates("no backend can take the request")
    for b in candidates:
        if b.degraded:
            good = [c for c in candidates if not c.degraded]
            return good or candidates
    return candidates


_FACTORIES: dict[str, Callable[..., RoutingPolicy]] = {}


def register_policy(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Class decorator: make a policy constructible by name through `make_policy`."""

    def decorate(factory: Callable[..., Any]) -> Callable[..., Any]:
        _FACTORIES[name] = factory
        return factory

    return decorate


def make_policy(name: str, **options: Any) -> RoutingPolicy:
    """A new policy by name, with its options as keyword arguments."""
    import edge.routing  # noqa: F401  (registers every policy)

    factory = _FACTORIES.get(name)
    if factory is None:
        raise ValueError(
            f"unknown routing policy {name!r}; choose one of {', '.join(POLICY_NAMES)}"
        )
    try:
        return factory(**options)
    except TypeError as exc:
        raise ValueError(f"bad options for routing policy {name!r}: {exc}") from None


__all__ = [
    "DEFAULT_POLICY",
    "POLICY_NAMES",
    "Decision",
    "NoCandidates",
    "Outcome",
    "RequestView",
    "RoutingPolicy",
    "make_policy",
    "register_policy",
    "usable",
]
