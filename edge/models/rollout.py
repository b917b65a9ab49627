"""The traffic split of one pool between its stable and its canary version.

`Rollout.to_canary` decides per request, in this order: the `x-canary` header (`1` canary, `0`
stable), the admitted tenant (`edge.admission`, from the API key) listed in `tenants` (canary),
then the canary share. A request with a session id is placed by a hash of that id against the
share, so every edge process places a session the same way and a session keeps its version while
the share holds or grows (a rising share only moves sessions from stable to canary, never back,
until a rollback). A request without one draws at random. The share itself is moved by
`edge.models.ramp.Ramp`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Literal

State = Literal["ramping", "paused", "held", "promoted", "rolled_back"]


def session_point(session: bytes) -> float:
    """A session's fixed point in [0, 1): the first 8 bytes of its BLAKE2b digest."""
    digest = hashlib.blake2b(session, digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


class Rollout:
    """Stable and canary version of one pool, and the canary's share of traffic (0..100 %)."""

    def __init__(
        self,
        pool: str,
        *,
        stable: str,
        canary: str,
        percent: float,
        tenants: frozenset[str] = frozenset(),
        header_rule: bool = True,
        entry: str = "",
    ) -> None:
        self.pool = pool
        self.stable = stable
        self.canary = canary
        self.percent = percent
        self.state: State = "ramping"
        self.reason = "started"
        self.tenants = tenants
        self.header_rule = header_rule
        self.entry = entry
        """The digest of the configured entry it runs (`entry_digest`): shared transitions
        carry it, and one of another entry is not taken."""

    def to_canary(
        self,
        *,
        tenant: str | None,
        header: bytes | None,
        session: bytes | None,
        draw: Callable[[], float],
    ) -> bool:
        if self.state == "rolled_back":
            return False
        if self.header_rule and header is not None:
            value = header.strip()
            if value in (b"1", b"true"):
                return True
            if value in (b"0", b"false"):
                return False
        if tenant is not None and tenant in self.tenants:
            return True
        share = self.percent / 100.0
        if share <= 0:
            return False
        if share >= 1:
            return True
        point = session_point(session) if session is not None else draw()
        return point < share


__all__ = ["Rollout", "State", "session_point"]
