"""Per-route early-data (0-RTT) policy: accept, defer or reject (RFC 8470 §3).

A request that arrives in 0-RTT may be a replay. quicedge makes each session ticket single-use
fleet-wide, so a captured first flight cannot be replayed against a *fresh* ticket; the route policy
decides what to do with requests that arrive before the handshake completes:

- ``accept``: serve at once; the app forwards upstream with ``Early-Data: 1`` (RFC 8470 §5.1).
- ``defer``: hold the request until the handshake completes, then serve it as a normal request.
- ``reject``: answer ``425 Too Early`` (RFC 8470 §5.2) without calling the app; clients retry
  after the handshake.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field


class Mode(enum.StrEnum):
    ACCEPT = "accept"
    DEFER = "defer"
    REJECT = "reject"


MODES: tuple[str, ...] = tuple(m.value for m in Mode)

# Inference routes are worth a round trip of TTFT and are protected by single-use tickets;
# embeddings, rerank and (de)tokenize change nothing on the backend, so a replay costs only the
# compute. Everything else (admin-like or unknown) waits for the handshake.
DEFAULT_ROUTES: dict[str, Mode] = {
    "/v1/chat/completions": Mode.ACCEPT,
    "/v1/completions": Mode.ACCEPT,
    "/generate": Mode.ACCEPT,
    "/v1/embeddings": Mode.ACCEPT,
    "/v1/rerank": Mode.ACCEPT,
    "/tokenize": Mode.ACCEPT,
    "/detokenize": Mode.ACCEPT,
    "/v1/responses": Mode.ACCEPT,
}
DEFAULT_MODE = Mode.DEFER


def parse_mode(value: str) -> Mode:
    """A mode from its name, with an error that lists the valid ones."""
    try:
        return Mode(value.strip().lower())
    except ValueError:
        raise ValueError(
            f"invalid early-data mode {value!r}: expected one of {', '.join(MODES)}"
        ) from None


@dataclass(frozen=True, slots=True)
class EarlyDataPolicy:
    """What to do with a request received in 0-RTT, by exact path (query string ignored)."""

    routes: Mapping[str, Mode] = field(default_factory=lambda: dict(DEFAULT_ROUTES))
    """Exact request paths and their mode."""
    default: Mode = DEFAULT_MODE
    """Mode for every path not in ``routes``."""

    def mode_for(self, path: str) -> Mode:
        return self.routes.get(path, self.default)

    def overridden(self, mode: Mode) -> EarlyDataPolicy:
        """The same policy with every route (and the default) set to ``mode`` (``--early-data``)."""
        return EarlyDataPolicy({p: mode for p in self.routes}, mode)

    @classmethod
    def from_mapping(cls, data: Mapping[str, object]) -> EarlyDataPolicy:
        """From TOML: ``{"default": "defer", "routes": {"/generate": "accept", ...}}``.

        Routes given in TOML are merged over the defaults.
        """
        unknown = set(data) - {"default", "routes"}
        if unknown:
            raise ValueError(f"unknown early-data settings: {', '.join(sorted(unknown))}")
        default = parse_mode(str(data.get("default", DEFAULT_MODE.value)))
        routes = dict(DEFAULT_ROUTES)
        raw = data.get("routes", {})
        if not isinstance(raw, Mapping):
            raise ValueError("early-data routes must be a table of path = mode")
        for path, mode in raw.items():
            if not isinstance(path, str) or not path.startswith("/"):
                raise ValueError(f"early-data route {path!r} must be a path starting with '/'")
            routes[path] = parse_mode(str(mode))
        return cls(routes, default)

    def describe(self) -> str:
        """One line for logs and ``--help``: ``/generate=accept, ..., *=defer``."""
        parts = [f"{p}={m.value}" for p, m in sorted(self.routes.items())]
        return ", ".join([*parts, f"*={self.default.value}"])
