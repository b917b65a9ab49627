"""The second track: throttle by backend queue depth, and the bounded priority queue.

A backend's depth (`depth = "waiting"`) is the larger of what it last reported
(`num_waiting_reqs` from `/v1/loads`, up to one poll old) and this edge's own requests on it that
have no first token yet (exact, and fresh between polls). A report of one waiting request counts
as none: it is SGLang's `/health` probe as often as not (see docs/admission.md). While its load
polls fail, the report is older than that and only the edge's own count is the depth. With
`depth = "in_flight"` it is every request this edge has on the backend: that also bounds the
backend's running batch, which is what keeps its KV pool from overflowing (a backend retracts
when running requests outgrow it).
Below `start_fraction × max_queue_depth` it takes every request; from there
the chance that it takes one falls linearly to zero at `max_queue_depth` (the design's rule: a
smooth slope rather than a cliff, so several edges do not all stop and start together).

A request that no backend takes waits in the admission queue: gold before silver before bronze,
the tenants of a tier taking turns (FIFO for each), among the requests that want the same
backends: the backends a waiter wants are its own to take first, and a request after it may take
only the others. So a request for another pool (a tier's own backends, another model) is not
held behind a waiter that cannot use its backends, and with one pool only the head looks. A
waiter looks again when a request ends here (`wake`) and every `recheck_s` (a load poll may have
freed room). A wait past `queue_timeout_s` is 503 `overloaded` with Retry-After, and so is a
full queue: for the newcomer, or, when it would come before the last waiter (a lower tier's, or
a tenant's of its tier with more rounds waiting), for that waiter, whose place it takes.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import random
import time
from collections.abc import Callable

from backends.registry import Backend
from edge.admission.headers import retry_after
from edge.admission.settings import ThrottleSettings
from edge.errors import Overloaded


class Throttle:
    def __init__(
        self, settings: ThrottleSettings, rng: Callable[[], float] = random.random
    ) -> None:
        assert settings.max_queue_depth is not None
        self.max_depth = settings.max_queue_depth
        self.start = settings.start_fraction * self.max_depth
        self._rng = rng
        self._in_flight = settings.depth == "in_flight"

    def depth(self, backend: Backend) -> int:
        if self._in_flight:
            return backend.in_flight
        load = backend.load
        if load is None or backend.load_polls_failing:
            # The registry keeps the last load while polls fail (for routing), however old: a
            # backend once busy would stay shut out, so only the edge's own count is trusted.
            return backend.in_prefill
        reported = load.num_waiting_reqs
        if reported == 1:
            # SGLang's /health sends a one-token probe through its scheduler at every check:
            # a poll that caught it shows one waiting on an idle backend, and at a depth of 1
            # that shut the backend until the next poll. A real lone waiter is let through.
            reported = 0
        return max(reported, backend.in_prefill)

    def share(self, backend: Backend) -> float:
        """The share of new requests the backend takes now, 0..1."""
        depth = self.depth(backend)
        if depth < self.start:
            return 1.0
        if depth >= self.max_depth:
            return 0.0
        return (self.max_depth - depth) / (self.max_depth - self.start)

    def admits(self, backend: Backend) -> bool:
        share = self.share(backend)
        return share >= 1.0 or (share > 0.0 and self._rng() < share)


class _Waiter:
    __slots__ = ("evicted", "tenant", "turn", "wants")

    def __init__(self, wants: frozenset[Backend], tenant: str) -> None:
        self.tenant = tenant
        self.turn = asyncio.Event()
        self.evicted = False
        """A newcomer of a higher tier took its place in the full queue."""
        self.wants = wants
        """Its candidates at its last look: the requests after it may not take these."""


_Entry = tuple[int, int, int, _Waiter]
"""(rank, round, arrival, waiter): the heap's order. A tenant's first waiter in its tier takes
the round of the tier's head, each next one the round after its tenant's last: so the tenants of
a tier take turns (FIFO for one tenant, and among the requests of one round), and one that sends
many waits behind the others' first rather than putting them behind all of its own."""


class AdmissionQueue:
    """Places requests on backends the throttle allows, queueing those it cannot place."""

    def __init__(
        self,
        settings: ThrottleSettings,
        throttle: Throttle,
        *,
        on_wait: Callable[[str, float, bool], None] | None = None,
    ) -> None:
        self.settings = settings
        self.throttle: Throttle | None = throttle
        self._heap: list[_Entry] = []
        self._seq = itertools.count()
        self._on_wait = on_wait
        self.retry_after = retry_after(settings.queue_timeout_s)

    @property
    def waiting(self) -> int:
        return len(self._heap)

    def _fit(self, candidates: list[Backend]) -> list[Backend]:
        throttle = self.throttle
        if throttle is None:  # turned off by a reload: whoever still waits goes
            return candidates
        return [b for b in candidates if throttle.admits(b)]

    def reconfigure(self, settings: ThrottleSettings) -> None:
        """A reloaded `[admission.throttle]`, for the next look of each request waiting and of
        every request after (a waiting request keeps the deadline it came with). Without
        `max_queue_depth` the queue lets everyone waiting go, one head after the other."""
        self.settings = settings
        self.throttle = Throttle(settings) if settings.max_queue_depth is not None else None
        self.retry_after = retry_after(settings.queue_timeout_s)
        self.wake()

    async def place(
        self,
        rank: int,
        tier: str,
        candidates: Callable[[], list[Backend]],
        tenant: str = "",
    ) -> list[Backend]:
        """Backends that may take this request now, waiting in the queue if needed.

        Returns [] only when there are no candidates at all (every backend down, or at its
        `--max-concurrency` cap): the app's usual 503 says which."""
        found = candidates()
        if not found:
            return found
        # Those waiting that rank with it or above are ahead of it: it passes them only on
        # backends none of them wants.
        claimed = self._claimed((rank, math.inf, math.inf))
        fit = self._fit([b for b in found if b not in claimed] if claimed else found)
        if fit:
            return fit
        wants = frozenset(found)
        turn = self._round(rank, tenant)
        if len(self._heap) >= self.settings.queue_size and not self._evict_after((rank, turn)):
            self._report(tier, 0.0, False)
            raise self._full()
        entry = (rank, turn, next(self._seq), _Waiter(wants, tenant))
        heapq.heappush(self._heap, entry)
        start = time.monotonic()
        deadline = start + self.settings.queue_timeout_s
        try:
            while True:
                if entry[3].evicted:
                    self._report(tier, time.monotonic() - start, False)
                    raise self._full()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                claimed = self._claimed(entry[:3])
                if not entry[3].wants <= claimed:  # it may take some of them: it looks
                    found = candidates()
                    fit = self._fit([b for b in found if b not in claimed] if claimed else found)
                    if fit or not found:  # none found: the caller's 503, no backend took it
                        self._leave(entry)
                        self._report(tier, time.monotonic() - start, bool(fit))
                        return fit
                    wants = frozenset(found)
                    if wants != entry[3].wants:  # those behind it may be free of it now
                        entry[3].wants = wants
                        self.wake()
                    wait = min(self.settings.recheck_s, remaining)
                else:
                    wait = remaining
                entry[3].turn.clear()
                try:
                    async with asyncio.timeout(wait):
                        await entry[3].turn.wait()
                except TimeoutError:
                    pass
        except BaseException:
            self._leave(entry)
            raise
        self._leave(entry)
        self._report(tier, time.monotonic() - start, False)
        raise Overloaded(
            f"no backend could take the request within {self.settings.queue_timeout_s:g}s; "
            "retry later",
            headers=self.retry_after,
        )

    def _full(self) -> Overloaded:
        return Overloaded(
            "every backend is saturated and the admission queue is full; retry later",
            headers=self.retry_after,
        )

    def _round(self, rank: int, tenant: str) -> int:
        """The round of a newcomer of `rank` from `tenant`: the one after its tenant's last
        waiter of that rank, or, with none, the round of that rank's head (0 when none waits)."""
        own, head = -1, -1
        for e in self._heap:
            if e[0] == rank:
                head = e[1] if head < 0 else min(head, e[1])
                if e[3].tenant == tenant:
                    own = max(own, e[1])
        return own + 1 if own >= 0 else max(head, 0)

    def _evict_after(self, key: tuple[int, int]) -> bool:
        """Make room in the full queue for a newcomer of `key` (rank, round) by taking out the
        last waiter in the queue's order, if it comes after the newcomer would: the latest of
        the lowest tier, and in a tier, the latest of the tenant that has the most rounds
        waiting. That waiter gets the queue-full 503. Without this, a lower tier keeping the
        queue full would shut the higher ones out, and one tenant keeping it full the others
        of its tier."""
        if not self._heap:
            return False
        last = max(self._heap)
        if last[:2] <= key:
            return False
        self._heap.remove(last)
        heapq.heapify(self._heap)
        last[3].evicted = True
        last[3].turn.set()
        return True

    def _claimed(self, key: tuple[float, float, float]) -> set[Backend]:
        """The backends the waiters ahead of `key` (rank, round, arrival) want: theirs to take
        first."""
        claimed: set[Backend] = set()
        for e in self._heap:
            if e[:3] < key:
                claimed |= e[3].wants
        return claimed

    def _leave(self, entry: _Entry) -> None:
        """Take the entry out of the queue and hand the turn to those it kept waiting."""
        if entry in self._heap:
            self._heap.remove(entry)
            heapq.heapify(self._heap)
            self.wake()

    def wake(self) -> None:
        """Room may have been freed: let every waiter that wants a backend no one ahead of it
        wants look again (with one pool, the head)."""
        if not self._heap:
            return
        if len(self._heap) == 1:
            self._heap[0][3].turn.set()
            return
        claimed: set[Backend] = set()
        for _, _, _, waiter in sorted(self._heap):
            if not waiter.wants <= claimed:
                waiter.turn.set()
            claimed |= waiter.wants

    def _report(self, tier: str, waited: float, placed: bool) -> None:
        if self._on_wait is not None:
            self._on_wait(tier, waited, placed)


__all__ = ["AdmissionQueue", "Throttle"]
