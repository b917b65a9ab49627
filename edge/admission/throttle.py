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
FIFO within a tier, among the requests that want the same backends: the backends a waiter wants
are its own to take first, and a request after it may take only the others. So a request for
another pool (a tier's own backends, another model) is not held behind a waiter that cannot use
its backends, and with one pool only the head looks. A waiter looks again when a request ends
here (`wake`) and every `recheck_s` (a load poll may have freed room). A wait past `queue_timeout_s`
is 503 `overloaded` with Retry-After, and so is a full queue: for the newcomer, or, when it
outranks the lowest-ranked waiter, for that waiter, whose place it takes.
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
    __slots__ = ("evicted", "turn", "wants")

    def __init__(self, wants: frozenset[Backend]) -> None:
        self.turn = asyncio.Event()
        self.evicted = False
        """A newcomer of a higher tier took its place in the full queue."""
        self.wants = wants
        """Its candidates at its last look: the requests after it may not take these."""


_Entry = tuple[int, int, _Waiter]
"""(rank, arrival, waiter): the heap's order."""


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
        self, rank: int, tier: str, candidates: Callable[[], list[Backend]]
    ) -> list[Backend]:
        """Backends that may take this request now, waiting in the queue if needed.

        Returns [] only when there are no candidates at all (every backend down, or at its
        `--max-concurrency` cap): the app's usual 503 says which."""
        found = candidates()
        if not found:
            return found
        # Those waiting that rank with it or above are ahead of it: it passes them only on
        # backends none of them wants.
        claimed = self._claimed((rank, math.inf))
        fit = self._fit([b for b in found if b not in claimed] if claimed else found)
        if fit:
            return fit
        wants = frozenset(found)
        if len(self._heap) >= self.settings.queue_size and not self._evict_below(rank):
            self._report(tier, 0.0, False)
            raise self._full()
        entry = (rank, next(self._seq), _Waiter(wants))
        heapq.heappush(self._heap, entry)
        start = time.monotonic()
        deadline = start + self.settings.queue_timeout_s
        try:
            while True:
                if entry[2].evicted:
                    self._report(tier, time.monotonic() - start, False)
                    raise self._full()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                claimed = self._claimed(entry[:2])
                if not entry[2].wants <= claimed:  # it may take some of them: it looks
                    found = candidates()
                    fit = self._fit([b for b in found if b not in claimed] if claimed else found)
                    if fit or not found:
                        self._leave(entry)
                        self._report(tier, time.monotonic() - start, True)
                        return fit
                    wants = frozenset(found)
                    if wants != entry[2].wants:  # those behind it may be free of it now
                        entry[2].wants = wants
                        self.wake()
                    wait = min(self.settings.recheck_s, remaining)
                else:
                    wait = remaining
                entry[2].turn.clear()
                try:
                    async with asyncio.timeout(wait):
                        await entry[2].turn.wait()
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

    def _evict_below(self, rank: int) -> bool:
        """Make room in the full queue for a newcomer of `rank` by taking out the last to come
        of its lowest-ranked waiters, if they rank below it; that waiter gets the queue-full
        503. Without this, a lower tier keeping the queue full would shut the higher ones out,
        and the queue's order (gold before silver before bronze) would not hold at its bound."""
        if not self._heap:
            return False
        last = max(self._heap)  # the lowest tier, and in it the latest: it has waited least
        if last[0] <= rank:
            return False
        self._heap.remove(last)
        heapq.heapify(self._heap)
        last[2].evicted = True
        last[2].turn.set()
        return True

    def _claimed(self, key: tuple[int, float]) -> set[Backend]:
        """The backends the waiters ahead of `key` (rank, arrival) want: theirs to take first."""
        claimed: set[Backend] = set()
        for e in self._heap:
            if e[:2] < key:
                claimed |= e[2].wants
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
            self._heap[0][2].turn.set()
            return
        claimed: set[Backend] = set()
        for _, _, waiter in sorted(self._heap):
            if not waiter.wants <= claimed:
                waiter.turn.set()
            claimed |= waiter.wants

    def _report(self, tier: str, waited: float, placed: bool) -> None:
        if self._on_wait is not None:
            self._on_wait(tier, waited, placed)


__all__ = ["AdmissionQueue", "Throttle"]
