"""The queue-depth throttle's slope, and the admission queue's order, bound and deadline."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from backends.registry import Backend
from backends.sglang import LoadSnapshot
from edge.admission.settings import AdmissionSettings, ThrottleSettings
from edge.admission.stage import Admission
from edge.admission.throttle import AdmissionQueue, Throttle
from edge.errors import Overloaded
from edge.telemetry import Metrics
from tests.helpers import wait_until


def load(waiting: int) -> LoadSnapshot:
    return LoadSnapshot(
        num_running_reqs=1, num_waiting_reqs=waiting, num_total_tokens=0, token_usage=0.0,
        max_total_tokens=None,
    )  # fmt: skip


def test_share_falls_linearly_from_80_percent_to_zero_at_the_maximum() -> None:
    throttle = Throttle(ThrottleSettings(max_queue_depth=10))
    backend = Backend(name="b", url="http://b:1")
    shares = []
    for waiting in (0, 7, 8, 9, 10, 15):
        backend.load = load(waiting)
        shares.append(throttle.share(backend))
    assert shares == [1.0, 1.0, 1.0, pytest.approx(0.5), 0.0, 0.0]
    backend.load = load(0)
    backend.in_prefill = 10  # the edge's own requests without a first token count too
    assert throttle.share(backend) == 0.0
    by_flight = Throttle(ThrottleSettings(max_queue_depth=10, depth="in_flight"))
    backend.in_prefill, backend.in_flight = 0, 9  # decoding requests count too
    assert by_flight.share(backend) == pytest.approx(0.5)


def test_a_load_its_polls_no_longer_refresh_gives_way_to_the_edges_own_count() -> None:
    throttle = Throttle(ThrottleSettings(max_queue_depth=10))
    backend = Backend(name="b", url="http://b:1", load=load(50))
    assert throttle.share(backend) == 0.0
    backend.load_polls_failing = 1  # the registry keeps the 50 for routing, however old
    assert throttle.depth(backend) == 0 and throttle.share(backend) == 1.0
    backend.in_prefill = 10  # the edge's own requests still count, exactly
    assert throttle.share(backend) == 0.0


def test_admits_by_the_share() -> None:
    draws = iter([0.2, 0.7])
    throttle = Throttle(ThrottleSettings(max_queue_depth=10), rng=lambda: next(draws))
    backend = Backend(name="b", url="http://b:1", load=load(9))  # share 0.5
    assert throttle.admits(backend)
    assert not throttle.admits(backend)


def settings(**values: float) -> ThrottleSettings:
    base = {"max_queue_depth": 1, "queue_size": 8, "queue_timeout_s": 20.0, "recheck_s": 5.0}
    base.update(values)
    return ThrottleSettings(**base)  # type: ignore[arg-type]


async def test_gold_before_silver_before_bronze_fifo_within_a_tier() -> None:
    backend = Backend(name="b", url="http://b:1", in_prefill=1)  # full: depth 1 of 1
    queue = AdmissionQueue(settings(), Throttle(settings()))
    order: list[str] = []

    async def request(name: str, rank: int) -> None:
        placed = await queue.place(rank, "tier", lambda: [backend])
        assert placed == [backend]
        order.append(name)
        backend.in_prefill += 1  # it takes the room it was given

    arrivals = [("bronze-1", 2), ("silver-1", 1), ("bronze-2", 2), ("gold-1", 0), ("gold-2", 0)]
    tasks = []
    for name, rank in arrivals:
        tasks.append(asyncio.ensure_future(request(name, rank)))
        await wait_until(lambda: queue.waiting == len(tasks))
    for placed in range(len(arrivals)):
        backend.in_prefill = 0  # one request ended: room for one
        queue.wake()
        await wait_until(lambda n=placed: len(order) > n)  # type: ignore[misc]
    await asyncio.gather(*tasks)
    assert order == ["gold-1", "gold-2", "silver-1", "bronze-1", "bronze-2"]


async def test_a_full_queue_and_a_deadline_are_503_with_retry_after() -> None:
    backend = Backend(name="b", url="http://b:1", in_prefill=1)
    s = settings(queue_size=1, queue_timeout_s=0.2, recheck_s=0.05)
    queue = AdmissionQueue(s, Throttle(s))
    waiting = asyncio.ensure_future(queue.place(0, "gold", lambda: [backend]))
    await wait_until(lambda: queue.waiting == 1)
    for rank in (0, 2):  # no one waiting ranks below the newcomer: the newcomer is refused
        with pytest.raises(Overloaded, match="queue is full") as full:
            await queue.place(rank, "tier", lambda: [backend])
        assert full.value.status == 503 and (b"retry-after", b"1") in full.value.extra_headers
    with pytest.raises(Overloaded, match="within 0.2s"):
        await waiting
    assert queue.waiting == 0


async def test_a_full_queue_gives_its_lowest_ranked_waiters_place_to_a_higher_tier() -> None:
    backend = Backend(name="b", url="http://b:1", in_prefill=1)  # full: depth 1 of 1
    s = settings(queue_size=3)
    refused: list[str] = []
    queue = AdmissionQueue(
        s, Throttle(s), on_wait=lambda tier, _, placed: None if placed else refused.append(tier)
    )
    order: list[str] = []

    async def request(name: str, rank: int) -> None:
        await queue.place(rank, name, lambda: [backend])
        order.append(name)
        backend.in_prefill += 1  # it takes the room it was given

    tasks: dict[str, asyncio.Future[None]] = {}
    arrivals = [
        ("silver-1", 1, 1, 0),
        ("bronze-1", 2, 2, 0),
        ("bronze-2", 2, 3, 0),
        ("gold", 0, 3, 1),
        ("silver-2", 1, 3, 2),
    ]  # (name, rank, waiting, refused)
    for name, rank, waiting, out in arrivals:
        tasks[name] = asyncio.ensure_future(request(name, rank))
        await wait_until(lambda w=waiting, o=out: queue.waiting == w and len(refused) == o)  # type: ignore[misc]
    # the gold request took the place of the last bronze to come, silver-2 the other bronze's
    assert refused == ["bronze-2", "bronze-1"]
    for name in ("bronze-2", "bronze-1"):
        with pytest.raises(Overloaded, match="queue is full") as full:
            await tasks.pop(name)
        assert (b"retry-after", b"20") in full.value.extra_headers  # as the newcomer's 503
    with pytest.raises(Overloaded, match="queue is full"):  # an equal rank takes no one's place
        await queue.place(1, "silver-3", lambda: [backend])
    for placed in range(3):
        backend.in_prefill = 0  # one request ended: room for one
        queue.wake()
        await wait_until(lambda n=placed: len(order) > n)  # type: ignore[misc]
    await asyncio.gather(*tasks.values())
    assert order == ["gold", "silver-1", "silver-2"] and queue.waiting == 0


async def test_no_candidates_at_all_is_not_queued() -> None:
    queue = AdmissionQueue(settings(), Throttle(settings()))
    assert await queue.place(0, "gold", lambda: []) == []
    assert queue.waiting == 0


async def test_a_reloaded_throttle_moves_the_waiting_and_turned_off_lets_them_all_go() -> None:
    backend = Backend(name="b", url="http://b:1", in_prefill=2)  # full at a depth of 1 or 2
    metrics = Metrics(CollectorRegistry())
    admission = Admission(AdmissionSettings(throttle=settings()), metrics=metrics)
    queue = admission.queue
    assert queue is not None

    async def request() -> list[Backend]:
        placed = await queue.place(2, "bronze", lambda: [backend])
        backend.in_prefill += 1  # it takes the room it was given
        return placed

    waiting = [asyncio.ensure_future(request()) for _ in range(3)]
    await wait_until(lambda: queue.waiting == 3)
    admission.set_throttle(settings(max_queue_depth=3))  # depth 2 is under 0.8 x 3 now
    assert await asyncio.wait_for(waiting[0], 5) == [backend]  # the head looked again at once
    await asyncio.sleep(0.1)
    assert queue.waiting == 2  # at a depth of 3 of 3, the next waits
    admission.set_throttle(ThrottleSettings())  # off: no throttle, no queue
    assert admission.queue is None
    assert await asyncio.wait_for(asyncio.gather(*waiting[1:]), 5) == [[backend], [backend]]
    assert queue.waiting == 0
    admission.set_throttle(settings(queue_size=0))  # on again, a new queue that holds nobody
    again = admission.queue
    assert again is not None and again is not queue
    with pytest.raises(Overloaded, match="queue is full"):
        await again.place(2, "bronze", lambda: [backend])
    with pytest.raises(ValueError, match="start_fraction"):
        admission.set_throttle(settings(start_fraction=1.5))
    assert admission.queue is again  # a setting that does not validate changes nothing
