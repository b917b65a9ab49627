"""The breaker state machine per isolation domain, driven with a settable clock: what opens a
breaker, what it stops (only its own domain), how half-open probes are bounded, how it closes.
The end-to-end tests with stand-ins are in tests/edge/test_breakers_sim.py."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from prometheus_client import CollectorRegistry

from backends.registry import Backend, BackendRegistry, LoadView, parse_labels
from edge.routing.breakers import BreakerConfig, Breakers


@dataclass
class Clock:
    now: float = 100.0

    def __call__(self) -> float:
        return self.now


def backend(name: str, fragment: str = "") -> Backend:
    url, labels = parse_labels(f"http://{name}:1#{fragment}")
    return Backend(name=name, url=url, labels=labels)


def make(config: BreakerConfig, *backends: Backend) -> tuple[Breakers, Clock, CollectorRegistry]:
    clock = Clock()
    registry = CollectorRegistry()
    return (
        Breakers(config.validate(), list(backends), registry=registry, clock=clock),
        clock,
        registry,
    )


def fail(breakers: Breakers, b: Backend, tier: str, n: int, kind: str | None = "5xx") -> None:
    for _ in range(n):
        breaker = breakers.started(b, tier)
        assert breaker is not None
        breakers.ended(breaker, kind, None)


SMALL = BreakerConfig(window=10, min_requests=4, error_rate=0.5, open_for=2.0, half_open_probes=2)


def test_labels_parse_and_bad_labels_are_named() -> None:
    url, labels = parse_labels("http://h:1#model=llama-v2&hardware=h100&tiers=gold+silver")
    assert url == "http://h:1"
    assert labels == {"model": "llama-v2", "hardware": "h100", "tiers": "gold+silver"}
    assert parse_labels("http://h:1") == ("http://h:1", {})
    for bad, says in [("colour=red", "colour=red"), ("tiers=platinum", "platinum"),
                      ("model=a&model=b", "twice"), ("model=", "model=")]:  # fmt: skip
        with pytest.raises(ValueError, match=says):
            parse_labels(f"http://h:1#{bad}")
    registry = BackendRegistry(["http://127.0.0.1:9#hardware=a100"], pool=None)
    assert registry.backends[0].url == "http://127.0.0.1:9"
    assert registry.backends[0].labels == {"hardware": "a100"}
    assert registry.snapshot()[0]["labels"] == {"hardware": "a100"}


def test_errors_open_only_their_tier_and_hardware_group() -> None:
    a1, a2 = backend("a1", "hardware=a"), backend("a2", "hardware=a")
    b1 = backend("b1", "hardware=b")
    breakers, _, registry = make(SMALL, a1, a2, b1)
    everyone = [a1, a2, b1]
    fail(breakers, a1, "bronze", 4)
    assert breakers.state_of("default", "bronze", "a") == "open"
    # bronze is kept off hardware group a; gold on the same backends, and bronze on b, flow
    assert breakers.allowed(everyone, "bronze") == [b1]
    assert breakers.allowed(everyone, "gold") == everyone
    assert breakers.state_of("default", "gold", "a") == "closed"
    gauge = registry.get_sample_value(
        "quicedge_breaker_state", {"model": "default", "tier": "bronze", "hardware": "a"}
    )
    assert gauge == 2
    opened = registry.get_sample_value(
        "quicedge_breaker_transitions_total",
        {"model": "default", "tier": "bronze", "hardware": "a", "to": "open"},
    )
    assert opened == 1


def test_client_errors_and_disconnects_do_not_open_a_breaker() -> None:
    a = backend("a")
    breakers, _, _ = make(SMALL, a)
    fail(breakers, a, "gold", 10, kind="4xx")
    fail(breakers, a, "gold", 10, kind="disconnect")
    assert breakers.state_of("default", "gold", "default") == "closed"


def test_half_open_lets_a_bounded_number_of_probes_through_then_closes() -> None:
    a, b = backend("a", "hardware=a"), backend("b", "hardware=b")
    breakers, clock, _ = make(SMALL, a, b)
    fail(breakers, a, "gold", 4)
    assert breakers.allowed([a, b], "gold") == [b]
    clock.now += 2.5
    assert breakers.allowed([a, b], "gold") == [a, b]
    assert breakers.state_of("default", "gold", "a") == "half_open"
    probes = [breakers.started(a, "gold"), breakers.started(a, "gold")]
    assert breakers.allowed([a, b], "gold") == [b]  # both probe slots are taken
    for probe in probes:
        assert probe is not None
        breakers.ended(probe, None, 0.01)
    assert breakers.state_of("default", "gold", "a") == "closed"
    assert breakers.allowed([a, b], "gold") == [a, b]


def test_a_failed_probe_opens_again_for_longer() -> None:
    a = backend("a")
    breakers, clock, _ = make(SMALL, a)
    fail(breakers, a, "gold", 4)
    clock.now += 2.5
    assert breakers.allowed([a], "gold") == [a]
    fail(breakers, a, "gold", 1)
    assert breakers.state_of("default", "gold", "default") == "open"
    clock.now += 2.5  # the open period doubled to 4 s
    assert breakers.allowed([a], "gold") == []
    clock.now += 2.0
    assert breakers.allowed([a], "gold") == [a]


def transitions(registry: CollectorRegistry, to: str, hardware: str = "default") -> float | None:
    return registry.get_sample_value(
        "quicedge_breaker_transitions_total",
        {"model": "default", "tier": "gold", "hardware": hardware, "to": to},
    )


def test_attempts_from_before_the_open_neither_free_probe_slots_nor_decide_anything() -> None:
    config = BreakerConfig(window=10, min_requests=4, open_for=2.0, half_open_probes=1)
    a = backend("a")
    breakers, clock, registry = make(config, a)
    # long requests sent while the domain was closed, still in flight when it opens
    before = [breakers.started(a, "gold") for _ in range(6)]
    fail(breakers, a, "gold", 4)
    clock.now += 2.5
    assert breakers.allowed([a], "gold") == [a]
    probe = breakers.started(a, "gold")
    assert probe is not None
    old = [t for t in before if t is not None]
    # An old success neither frees the probe's slot nor closes the breaker; an old timeout
    # does not open it again (nor lengthen its next open period).
    breakers.ended(old[0], None, 0.01)
    breakers.ended(old[1], "timeout", None)
    assert breakers.state_of("default", "gold", "default") == "half_open"
    assert breakers.allowed([a], "gold") == []  # the one slot is still the probe's
    assert breakers.snapshot()[0]["probes_in_flight"] == 1
    breakers.ended(probe, None, 0.01)
    assert breakers.state_of("default", "gold", "default") == "closed"
    # After the close the windows start empty: the old failures do not re-open it.
    for ticket in old[2:]:
        breakers.ended(ticket, "5xx", None)
    assert breakers.state_of("default", "gold", "default") == "closed"
    assert breakers.snapshot()[0]["outcomes"] == 0
    labels = {"model": "default", "tier": "gold", "hardware": "default"}
    assert registry.get_sample_value("quicedge_breaker_state", labels) == 0
    assert [transitions(registry, to) for to in ("open", "half_open", "closed")] == [1, 1, 1]


def test_a_probe_of_an_earlier_half_open_period_counts_in_none_after_it() -> None:
    a = backend("a")
    breakers, clock, _ = make(SMALL, a)  # two probes at once, two successes to close
    fail(breakers, a, "gold", 4)
    clock.now += 2.5
    assert breakers.allowed([a], "gold") == [a]
    long_probe = breakers.started(a, "gold")  # a long stream
    fail(breakers, a, "gold", 1)  # the other probe fails: open again, for 4 s
    clock.now += 4.5
    assert breakers.allowed([a], "gold") == [a]
    probe = breakers.started(a, "gold")
    assert long_probe is not None and probe is not None
    breakers.ended(long_probe, None, 0.01)  # no slot of this period to give back, no success
    assert breakers.snapshot()[0]["probes_in_flight"] == 1
    assert breakers.allowed([a], "gold") == [a]
    second = breakers.started(a, "gold")
    assert second is not None
    breakers.ended(probe, None, 0.01)
    assert breakers.state_of("default", "gold", "default") == "half_open"  # one of two
    breakers.release(probe)  # a second release gives nothing back
    assert breakers.snapshot()[0]["probes_in_flight"] == 1
    breakers.ended(second, None, 0.01)
    assert breakers.state_of("default", "gold", "default") == "closed"


def test_attempts_in_flight_in_a_domain_a_relabel_forgot_end_uncounted() -> None:
    a = backend("a", "model=m@v1")
    breakers, _, registry = make(SMALL, a)
    in_flight = [breakers.started(a, "gold") for _ in range(4)]
    a.set_model("m", "v2")  # the catalog learned another version: a new domain
    breakers.relabel()
    for ticket in in_flight:
        assert ticket is not None
        breakers.ended(ticket, "5xx", None)
    # the forgotten domain did not open unseen, with a gauge nobody would ever clear
    labels = {"model": "m@v1", "tier": "gold", "hardware": "default"}
    assert registry.get_sample_value("quicedge_breaker_state", labels) is None
    assert breakers.state_of("m@v1", "gold", "default") is None
    assert breakers.allowed([a], "gold") == [a]
    assert breakers.state_of("m@v2", "gold", "default") == "closed"
    assert [d["model"] for d in breakers.snapshot()] == ["m@v2"]


def test_slow_ttft_opens_and_the_prefill_allowance_is_taken_off() -> None:
    config = BreakerConfig(ttft_window=10, ttft_min_samples=8, ttft_open_p99=0.2,
                           ttft_per_prompt_token=0.001)  # fmt: skip
    a, b = backend("a", "hardware=a"), backend("b", "hardware=b")
    breakers, _, _ = make(config, a, b)
    for _ in range(8):
        # 0.5 s, of which 0.4 s is the allowed prefill of 400 uncached tokens
        breaker = breakers.started(a, "gold")
        assert breaker is not None
        breakers.ended(breaker, None, 0.5, 400)
    assert breakers.state_of("default", "gold", "a") == "closed"
    for _ in range(8):
        breaker = breakers.started(b, "gold")
        assert breaker is not None
        breakers.ended(breaker, None, 0.5, 0)
    assert breakers.state_of("default", "gold", "b") == "open"
    assert breakers.allowed([a, b], "gold") == [a]


def slow(breakers: Breakers, b: Backend, n: int, ttft: float = 0.5) -> None:
    for _ in range(n):
        breaker = breakers.started(b, "gold")
        assert breaker is not None
        breakers.ended(breaker, None, ttft, 0)


def test_a_domain_open_on_its_ttft_alone_still_serves_when_nowhere_else_can() -> None:
    config = BreakerConfig(ttft_window=10, ttft_min_samples=8, ttft_open_p99=0.2, open_for=2.0,
                           window=10, min_requests=4, half_open_probes=1)  # fmt: skip
    a, b = backend("a", "hardware=a"), backend("b", "hardware=b")
    breakers, clock, registry = make(config, a, b)
    slow(breakers, a, 8)
    assert breakers.state_of("default", "gold", "a") == "open"
    assert breakers.allowed([a, b], "gold") == [b]  # somewhere faster: the slow one is shed
    slow(breakers, b, 8)
    assert breakers.state_of("default", "gold", "b") == "open"
    # every domain open, both on latency alone: serve slowly rather than refuse
    assert breakers.allowed([a, b], "gold") == [a, b]
    assert breakers.snapshot()[0]["slow_only"] is True
    served = registry.get_sample_value(
        "quicedge_breaker_last_resort_requests_total", {"tier": "gold"}
    )
    assert served == 1
    # a domain open on errors is never a last resort
    fail(breakers, a, "silver", 4)
    assert breakers.allowed([a], "silver") == []
    # once half-open with its probe slot taken, the slow domain is still the last resort
    clock.now += 2.0
    assert breakers.allowed([a], "gold") == [a]
    probe = breakers.started(a, "gold")
    assert probe is not None
    assert breakers.allowed([a], "gold") == [a]
    breakers.ended(probe, None, 0.01)
    assert breakers.state_of("default", "gold", "a") == "closed"


def test_the_last_resort_can_be_turned_off() -> None:
    config = BreakerConfig(ttft_window=10, ttft_min_samples=8, ttft_open_p99=0.2,
                           slow_last_resort=False)  # fmt: skip
    a = backend("a")
    breakers, _, _ = make(config, a)
    slow(breakers, a, 8)
    assert breakers.state_of("default", "gold", "default") == "open"
    assert breakers.allowed([a], "gold") == []


def test_kv_usage_past_the_threshold_sheds_its_group_until_it_drains() -> None:
    config = BreakerConfig(kv_warn=0.6, kv_open=0.85, open_for=1.0, half_open_probes=1)
    a, b = backend("a", "hardware=a"), backend("b", "hardware=b")
    breakers, clock, _ = make(config, a, b)

    def load(usage: float) -> LoadView:
        return LoadView(num_running_reqs=1, num_waiting_reqs=0, num_total_tokens=0,
                        token_usage=usage, max_total_tokens=1000)  # fmt: skip

    a.load, b.load = load(0.7), load(0.1)
    breakers.update_kv()
    snapshot = {(d["tier"], d["hardware"]): d for d in breakers.snapshot()}
    assert snapshot[("gold", "a")]["health"] == "warning"
    assert snapshot[("gold", "b")]["health"] == "healthy"
    a.load = load(0.9)
    breakers.update_kv()
    for tier in ("gold", "silver", "bronze"):
        assert breakers.allowed([a, b], tier) == [b]
    clock.now += 1.5
    assert breakers.allowed([a, b], "gold") == [b]  # still full: no probe is worth sending
    a.load = load(0.2)
    breakers.update_kv()
    clock.now += 1.5
    assert breakers.allowed([a, b], "gold") == [a, b]
    probe = breakers.started(a, "gold")
    assert probe is not None
    breakers.ended(probe, None, 0.01)
    assert breakers.state_of("default", "gold", "a") == "closed"


def test_a_backend_serves_only_the_tiers_its_label_names() -> None:
    gold_only = backend("g", "tiers=gold")
    anyone = backend("x")
    breakers, _, _ = make(BreakerConfig(), gold_only, anyone)
    assert breakers.allowed([gold_only, anyone], "gold") == [gold_only, anyone]
    assert breakers.allowed([gold_only, anyone], "bronze") == [anyone]


def test_the_all_closed_shortcut_still_sees_tiers_and_new_backends() -> None:
    anyone = backend("x")
    breakers, _, _ = make(SMALL, anyone)
    breakers.update_kv()  # a full scan: every breaker closed, no tier left out
    candidates = [anyone]
    assert breakers.allowed(candidates, "bronze") is candidates
    gold_only = backend("g", "tiers=gold")
    breakers.backends.append(gold_only)  # as discovery adds one, between two scans
    assert breakers.allowed([anyone, gold_only], "bronze") == [anyone]
    fail(breakers, anyone, "silver", 4)
    assert breakers.allowed([anyone, gold_only], "silver") == []


def test_disabled_breakers_pass_every_candidate() -> None:
    a = backend("a", "tiers=gold")
    breakers, _, _ = make(BreakerConfig(enabled=False, min_requests=1), a)
    candidates = [a]
    assert breakers.started(a, "gold") is None
    assert breakers.allowed(candidates, "bronze") is candidates


@pytest.mark.parametrize(
    ("values", "says"),
    [({"kv_warn": 0.9, "kv_open": 0.8}, "kv_warn"), ({"window": 0}, "breakers.window"),
     ({"ttft_warn_p99": 0.3}, "ttft_warn_p99"), ({"error_rate": 0}, "error_rate")],
)  # fmt: skip
def test_bad_settings_are_named(values: dict[str, float], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        BreakerConfig.from_mapping(values).validate()
    with pytest.raises(ValueError, match="unknown"):
        BreakerConfig.from_mapping({"windw": 3})


async def test_a_reload_moves_thresholds_keeps_the_newest_outcomes_and_off_closes_all() -> None:
    a, b = backend("a", "hardware=a"), backend("b", "hardware=b")
    breakers, _, registry = make(SMALL, a, b)
    fail(breakers, a, "gold", 3)  # three of ten, under min_requests 4: closed
    assert breakers.state_of("default", "gold", "a") == "closed"
    # A lower bar applies from the next outcome, over the outcomes kept.
    await breakers.reconfigure(BreakerConfig(window=10, min_requests=2, error_rate=0.5))
    fail(breakers, a, "gold", 1)
    assert breakers.state_of("default", "gold", "a") == "open"
    # A smaller window keeps the newest outcomes: two successes and a failure of the last 3.
    for error in (None, None, "5xx"):
        breaker = breakers.started(b, "gold")
        assert breaker is not None
        breakers.ended(breaker, error, None)
    await breakers.reconfigure(BreakerConfig(window=3, min_requests=3, error_rate=0.5))
    assert breakers.state_of("default", "gold", "b") == "closed"  # one of three: 33 %
    fail(breakers, b, "gold", 1)  # the window slides: two of three
    assert breakers.state_of("default", "gold", "b") == "open"
    # Off: every domain closes and takes work; the KV poll stops.
    await breakers.reconfigure(BreakerConfig(enabled=False))
    assert breakers.allowed([a, b], "gold") == [a, b]
    assert breakers.started(a, "gold") is None
    assert {breakers.state_of("default", "gold", h) for h in "ab"} == {"closed"}
    labels = {"model": "default", "tier": "gold", "hardware": "a"}
    assert registry.get_sample_value("quicedge_breaker_state", labels) == 0
    assert breakers._task is None
    # On again: the poll starts, and the domains start from empty windows.
    await breakers.reconfigure(SMALL)
    assert breakers._task is not None
    fail(breakers, a, "gold", 3)
    assert breakers.state_of("default", "gold", "a") == "closed"
    with pytest.raises(ValueError, match="min_requests"):
        await breakers.reconfigure(BreakerConfig(window=2, min_requests=3))
    await breakers.aclose()


async def test_attempts_in_flight_when_the_breakers_are_turned_off_are_not_counted() -> None:
    a = backend("a")
    breakers, _, registry = make(SMALL, a)
    in_flight = [breakers.started(a, "gold") for _ in range(4)]
    await breakers.reconfigure(BreakerConfig(enabled=False, window=10, min_requests=4))
    for ticket in in_flight:
        assert ticket is not None
        breakers.ended(ticket, "5xx", None)
    # off, nothing is counted: their failures do not open the domain behind the operator's back
    assert breakers.state_of("default", "gold", "default") == "closed"
    labels = {"model": "default", "tier": "gold", "hardware": "default"}
    assert registry.get_sample_value("quicedge_breaker_state", labels) == 0
    await breakers.reconfigure(SMALL)
    # on again, the domain starts from closed with empty windows
    assert breakers.allowed([a], "gold") == [a]
    assert breakers.snapshot()[0]["outcomes"] == 0
    await breakers.aclose()


def test_a_half_open_domain_whose_backends_left_is_dropped_with_its_gauge() -> None:
    """Its probes in flight end uncounted, and no gauge series of it is left behind."""
    a, b = backend("a", "hardware=a"), backend("b", "hardware=b")
    breakers, clock, registry = make(SMALL, a, b)
    fail(breakers, a, "gold", 4)
    clock.now += SMALL.open_for
    assert breakers.allowed([a, b], "gold") == [a, b]  # half-open now: a probe may go
    probe = breakers.started(a, "gold")
    assert probe is not None and breakers.state_of("default", "gold", "a") == "half_open"
    breakers.backends.remove(a)  # what a reload or discovery does to the registry's list
    breakers.update_kv()
    labels = {"model": "default", "tier": "gold", "hardware": "a"}
    assert registry.get_sample_value("quicedge_breaker_state", labels) is None
    assert breakers.state_of("default", "gold", "a") is None
    breakers.ended(probe, "5xx", None)  # the probe's late failure reopens nothing
    assert registry.get_sample_value("quicedge_breaker_state", labels) is None
    assert breakers.allowed([b], "gold") == [b]
    assert breakers._not_closed == 0  # every breaker left is closed: the shortcut is back


def test_a_backend_relabelled_before_relabel_is_called_is_never_left_in_a_dropped_domain() -> None:
    """The catalog sets a backend's model, then awaits its other backends before it calls
    `relabel`: a KV poll in between drops the old domain, and the requests sent meanwhile
    count in the new one, not in a dropped breaker whose gauge nobody would clear again."""
    a = backend("a", "model=m@v1")
    breakers, _, registry = make(SMALL, a)
    breakers.update_kv()
    a.set_model("m", "v2")
    breakers.update_kv()  # the poll, before the catalog's `relabel`
    fail(breakers, a, "gold", 4)
    old = {"model": "m@v1", "tier": "gold", "hardware": "default"}
    assert registry.get_sample_value("quicedge_breaker_state", old) is None
    assert breakers.state_of("m@v2", "gold", "default") == "open"
    breakers.relabel()
    assert breakers.allowed([a], "gold") == []  # still open: the relabel did not forget it


def test_a_refusals_retry_after_is_its_own_domains_wait_not_another_models() -> None:
    """Another model's domain reopening sooner serves this request nothing: the client told
    to come back in a second would be refused again for the rest of its own domain's wait."""
    a, b = backend("a", "model=llama"), backend("b", "model=qwen")
    breakers, clock, _ = make(BreakerConfig(window=10, min_requests=4, error_rate=0.5,
                                            open_for=30.0, half_open_probes=2), a, b)  # fmt: skip
    fail(breakers, a, "silver", 4)  # llama opens, 30 s to go
    clock.now += 28.0
    fail(breakers, b, "silver", 4)  # qwen opens 28 s later: 30 s to go, llama's 2 s
    assert breakers.refused("silver", [b]) == 30.0
    assert breakers.refused("silver", [a]) == 2.0
    assert breakers.refused("silver") == 2.0  # the tier's soonest when the request's are unknown
