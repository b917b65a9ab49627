"""Each policy's decisions on synthetic candidates (registry Backends with set counts)."""

from __future__ import annotations

from collections import Counter

import pytest

from backends.registry import Backend, LoadView
from edge.routing import POLICY_NAMES, Decision, NoCandidates, Outcome, RequestView, make_policy
from edge.routing.cache_aware import CacheAware
from edge.routing.ttft import TTFTPolicy


def fleet(n: int = 4) -> list[Backend]:
    return [Backend(name=f"b{i}", url=f"http://127.0.0.1:{9000 + i}") for i in range(n)]


def view(text: str, tokens: int | None = None, session: str | None = None) -> RequestView:
    return RequestView(
        route="/generate",
        text=text,
        approx_tokens=tokens if tokens is not None else max(1, len(text) // 4),
        session_key=session,
    )


def test_every_name_makes_its_policy() -> None:
    assert set(POLICY_NAMES) == {
        "round_robin",
        "random",
        "least_load",
        "power_of_two",
        "cache_aware",
        "ttft",
    }
    for name in POLICY_NAMES:
        policy = make_policy(name)
        assert policy.name == name
        decision = policy.choose(view("hello world"), fleet())
        assert isinstance(decision, Decision)
        policy.observe(
            Outcome(
                backend=decision.backend, view=view("hello world"), decision=decision, ttft_s=0.01
            )
        )


def test_bad_policy_name_and_options() -> None:
    with pytest.raises(ValueError, match="unknown routing policy 'fastest'.*ttft"):
        make_policy("fastest")
    with pytest.raises(ValueError, match="bad options"):
        make_policy("round_robin", seed=1)
    with pytest.raises(ValueError, match="cache_threshold"):
        make_policy("cache_aware", cache_threshold=2.0)
    with pytest.raises(ValueError, match="session slack"):
        make_policy("ttft", session_slack=-1)


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_no_candidates_is_an_error(name: str) -> None:
    with pytest.raises(NoCandidates):
        make_policy(name).choose(view("x"), [])


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_degraded_only_when_nothing_else(name: str) -> None:
    backends = fleet(3)
    backends[0].degraded = backends[1].degraded = True
    policy = make_policy(name)
    for _ in range(10):
        assert policy.choose(view("some prompt"), backends).backend is backends[2]
    backends[2].degraded = True
    seen = {policy.choose(view(chr(65 + i) * 8), backends).backend.name for i in range(30)}
    assert seen <= {"b0", "b1", "b2"} and len(seen) >= 2


def test_round_robin_cycles() -> None:
    backends = fleet(3)
    policy = make_policy("round_robin")
    assert [policy.choose(view("x"), backends).backend.name for _ in range(6)] == [
        "b0",
        "b1",
        "b2",
        "b0",
        "b1",
        "b2",
    ]


def test_random_is_seeded_and_covers_the_fleet() -> None:
    backends = fleet(4)
    a = [make_policy("random", seed=5).choose(view("x"), backends).backend.name for _ in range(1)]
    p1, p2 = make_policy("random", seed=5), make_policy("random", seed=5)
    seq1 = [p1.choose(view("x"), backends).backend.name for _ in range(50)]
    seq2 = [p2.choose(view("x"), backends).backend.name for _ in range(50)]
    assert seq1 == seq2 and set(seq1) == {"b0", "b1", "b2", "b3"} and a[0] == seq1[0]


def test_least_load_picks_fewest_in_flight_and_spreads_ties() -> None:
    backends = fleet(3)
    backends[0].in_flight, backends[1].in_flight, backends[2].in_flight = 5, 1, 3
    policy = make_policy("least_load")
    assert policy.choose(view("x"), backends).backend is backends[1]
    for b in backends:
        b.in_flight = 0
    picks = Counter(policy.choose(view("x"), backends).backend.name for _ in range(30))
    assert picks == {"b0": 10, "b1": 10, "b2": 10}


def test_power_of_two_prefers_the_less_loaded_of_two() -> None:
    backends = fleet(2)
    backends[0].in_flight = 9
    policy = make_policy("power_of_two", seed=1)
    assert all(policy.choose(view("x"), backends).backend is backends[1] for _ in range(20))
    backends = fleet(4)
    backends[3].in_flight = 100
    picks = Counter(policy.choose(view("x"), backends).backend.name for _ in range(200))
    assert "b3" not in picks  # the most loaded can never win a pair


# -- cache_aware ----------------------------------------------------------------------------


def test_cache_aware_follows_the_prefix() -> None:
    backends = fleet(4)
    policy = CacheAware()
    system = "You are a helpful assistant. " * 20
    first = policy.choose(view(system + "question one"), backends)
    assert first.reason == "cache_miss"
    backends[1].in_flight = 0
    first.backend.in_flight = 3  # a little busier, still balanced
    again = policy.choose(view(system + "question two"), backends)
    assert again.backend is first.backend and again.reason == "cache_hit"
    assert again.predicted_cached_tokens > 100


def test_cache_aware_miss_goes_to_least_loaded() -> None:
    backends = fleet(3)
    backends[0].in_flight, backends[1].in_flight, backends[2].in_flight = 4, 2, 3
    decision = CacheAware().choose(view("a prompt nobody has seen"), backends)
    assert decision.backend is backends[1] and decision.reason == "cache_miss"


def test_cache_aware_threshold_is_strict() -> None:
    backends = fleet(2)
    backends[0].in_flight = 1
    for text, reason in (("abcdeVWXYZ", "cache_miss"), ("abcdefVWXY", "cache_hit")):
        policy = CacheAware(cache_threshold=0.5)
        policy.tree.insert("abcdef", backends[0].url)
        decision = policy.choose(view(text), backends)  # 0.5 is not > 0.5; 0.6 is
        assert decision.reason == reason
        assert decision.backend is backends[0 if reason == "cache_hit" else 1]


def test_cache_aware_switches_to_least_loaded_when_imbalanced() -> None:
    backends = fleet(2)
    policy = CacheAware()  # abs 64, rel 1.5
    text = "shared prefix " * 10
    policy.tree.insert(text, backends[0].url)
    backends[0].in_flight = 64
    assert policy.choose(view(text), backends).backend is backends[0]  # gap 64 is not > 64
    backends[0].in_flight = 65
    decision = policy.choose(view(text), backends)
    assert decision.backend is backends[1] and decision.reason == "imbalanced"
    backends[0].in_flight, backends[1].in_flight = 170, 100  # gap 70 > 64, 170 > 150
    assert policy.choose(view(text), backends).reason == "imbalanced"
    backends[0].in_flight, backends[1].in_flight = 280, 200  # 280 <= 300: balanced
    assert policy.choose(view(text), backends).reason == "cache_hit"


def test_cache_aware_learns_generated_text() -> None:
    backends = fleet(3)
    policy = CacheAware()
    turn1 = view("user: tell me a story\nassistant:")
    d = policy.choose(turn1, backends)
    answer = " Once upon a time there was a radix tree." * 5
    policy.observe(Outcome(backend=d.backend, view=turn1, decision=d, completion_text=answer))
    turn2 = view(turn1.text + answer + "\nuser: and then?\nassistant:")
    m = policy.tree.match(turn2.text)
    assert m.chars[d.backend.url] == len(turn1.text + answer)


# -- ttft -----------------------------------------------------------------------------------

SYSTEM = "S" * 8000  # 2000 tokens at 4 chars per token


def test_ttft_prefers_the_backend_holding_the_prefix_when_idle() -> None:
    backends = fleet(4)
    policy = TTFTPolicy()
    policy.tree.insert(SYSTEM, backends[2].url)
    d = policy.choose(view(SYSTEM + "q" * 400), backends)
    assert d.backend is backends[2]
    assert d.predicted_cached_tokens == 2000
    assert d.predicted_ttft_s is not None and d.predicted_ttft_s < 0.03


def test_ttft_spills_a_hot_prefix_when_its_queue_costs_more_than_a_prefill() -> None:
    backends = fleet(2)
    policy = TTFTPolicy()
    policy.tree.insert(SYSTEM, backends[0].url)
    request = view(SYSTEM + "q" * 400)  # 2100 tokens, 2000 of them cached on b0
    backends[0].in_flight = backends[0].in_prefill = 4
    # Staying costs the queue; moving costs a 2100-token prefill plus a share of it for the
    # requests that will queue behind the miss (miss_penalty 0.5, times b1's in-flight
    # relative to the fleet's: 1/3 here), so about 2450 tokens.
    backends[0].in_flight_prefill_tokens = 2200
    assert policy.choose(request, backends).backend is backends[0]
    backends[0].in_flight_prefill_tokens = 2700  # now waiting costs more than prefilling
    d = policy.choose(request, backends)
    assert d.backend is backends[1] and d.predicted_cached_tokens == 0
    # and b1 now holds the prefix too: the hot prefix lives on two backends
    assert policy.tree.match(SYSTEM).chars.keys() == {backends[0].url, backends[1].url}


def test_ttft_without_shared_prefixes_spreads_like_least_load() -> None:
    backends = fleet(4)
    policy = TTFTPolicy()
    picks = Counter()
    for i in range(40):
        d = policy.choose(view(f"{i:04d} unique prompt " * 10), backends)
        picks[d.backend.name] += 1
    assert picks == {"b0": 10, "b1": 10, "b2": 10, "b3": 10}
    backends[3].in_flight = backends[3].in_prefill = 2
    backends[3].in_flight_prefill_tokens = 300
    assert policy.choose(view("fresh prompt " * 10), backends).backend is not backends[3]


def test_ttft_counts_work_it_did_not_send_from_v1_loads() -> None:
    backends = fleet(2)
    policy = TTFTPolicy()
    backends[0].load = LoadView(
        num_running_reqs=0,
        num_waiting_reqs=20,
        num_total_tokens=0,
        token_usage=0.1,
        max_total_tokens=None,
    )
    assert all(
        policy.choose(view(f"p{i} " * 50), backends).backend is backends[1] for i in range(5)
    )


def test_session_key_breaks_ties_but_yields_to_load() -> None:
    backends = fleet(2)
    policy = TTFTPolicy()
    first = policy.choose(view("hello there " * 10, session="s1"), backends)
    home = first.backend
    other = backends[1] if home is backends[0] else backends[0]
    for i in range(5):  # idle fleet, nothing cached: the session stays home
        assert policy.choose(view(f"new {i} " * 10, session="s1"), backends).backend is home
    home.in_flight = home.in_prefill = 3
    home.in_flight_prefill_tokens = 3000  # far more than the slack allows
    d = policy.choose(view("another " * 10, session="s1"), backends)
    assert d.backend is other
    assert policy.choose(view("more " * 10, session="s1"), backends).backend is other


def test_ttft_learns_the_cost_coefficients() -> None:
    """Outcomes from a fleet 3x slower than the priors: predictions converge to the truth."""
    backends = fleet(1)
    b = backends[0]
    policy = TTFTPolicy()
    true_b, true_a = 0.040, 100e-6
    errors = []
    for i in range(300):
        tokens = 100 + (i * 37) % 2000
        b.in_flight_prefill_tokens = (i * 53) % 3000
        v = view(f"{i:05d}" + "z" * (tokens * 4 - 5), tokens)
        d = policy.choose(v, backends)
        truth = true_b + true_a * (b.in_flight_prefill_tokens + tokens - d.predicted_cached_tokens)
        assert d.predicted_ttft_s is not None
        errors.append(abs(d.predicted_ttft_s - truth) / truth)
        policy.observe(Outcome(backend=b, view=v, decision=d, ttft_s=truth))
    assert errors[0] > 0.5  # the priors are far off at first
    assert sum(errors[-50:]) / 50 < 0.05
    b_hat, a_hat, _, _ = policy.coefficients()
    assert a_hat == pytest.approx(true_a, rel=0.1) and b_hat == pytest.approx(true_b, rel=0.2)


def test_reported_misses_trim_the_tree_and_shrink_the_capacity() -> None:
    backends = fleet(2)
    b = backends[0]
    policy = TTFTPolicy()
    prefix = "P" * 4000
    for i in range(10):  # ten conversations under one prefix, all believed cached on b0
        policy.tree.insert(prefix + f"branch {i} " + "x" * 400, b.url)
    held_before = policy.tree.tenant_chars(b.url)
    request = view(prefix + "branch 0 " + "x" * 400 + " follow-up", 1100)
    d = policy.choose(request, [b])
    assert d.predicted_cached_tokens > 1000
    # the backend reports it held only the first 500 tokens (2000 chars): it evicted
    policy.observe(
        Outcome(
            backend=b, view=request, decision=d, ttft_s=0.05, prompt_tokens=1100, cached_tokens=500
        )
    )
    assert policy.trims == 1
    for i in range(1, 10):  # the siblings below the evicted point are gone; the re-cached
        # request shares only "branch " with them
        sibling = prefix + f"branch {i} " + "x" * 400
        assert policy.tree.match(sibling).chars[b.url] == len(prefix + "branch ")
    assert policy.tree.match(request.text).chars[b.url] == len(request.text)  # re-cached
    limit = policy.tree.limit(b.url)
    assert limit is not None and limit < held_before
    # accurate reports let the estimate grow back
    d2 = policy.choose(request, [b])
    policy.observe(
        Outcome(
            backend=b,
            view=request,
            decision=d2,
            ttft_s=0.01,
            prompt_tokens=1100,
            cached_tokens=1099,
        )
    )
    assert (policy.tree.limit(b.url) or 0) > limit


def test_capacity_comes_from_the_kv_pool_size() -> None:
    backends = fleet(1)
    b = backends[0]
    b.load = LoadView(
        num_running_reqs=0,
        num_waiting_reqs=0,
        num_total_tokens=0,
        token_usage=0.0,
        max_total_tokens=1000,
    )
    policy = TTFTPolicy(capacity_fraction=1.0)
    for i in range(20):
        policy.choose(view(f"{i:03d}" + "t" * 797, 200), backends)  # 800 chars each
    assert policy.tree.tenant_chars(b.url) <= 4000  # 1000 tokens at 4 chars per token


def test_connect_failure_forgets_the_backends_cache() -> None:
    backends = fleet(2)
    policy = TTFTPolicy()
    v = view("cached text " * 20)
    d = policy.choose(v, backends)
    policy.observe(Outcome(backend=d.backend, view=v, decision=d, error="connect"))
    assert policy.tree.match(v.text).chars == {}


def test_learning_stays_in_bounds_under_outliers() -> None:
    """A burst of huge TTFTs that correlate with decoding load must not teach the policy that
    decoding matters more than cached tokens."""
    backends = fleet(2)
    policy = TTFTPolicy()
    for i in range(400):
        b = backends[i % 2]
        b.in_flight = 30 + i % 7  # decoding requests
        v = view(f"{i:05d}" + "w" * 2000, 500)
        d = policy.choose(v, [b])
        policy.observe(Outcome(backend=b, view=v, decision=d, ttft_s=5.0 + (i % 7)))
    b_hat, a_hat, c_hat, d_hat = policy.coefficients()
    assert a_hat >= 33e-6 / 10
    assert d_hat <= 0.001  # at most 1 ms per decoding request
    # so a cached prefix still wins over a backend with a few fewer decoding requests
    for b in backends:
        b.in_flight = b.in_prefill = 0
    backends[0].in_flight = 5
    policy.tree.insert(SYSTEM, backends[0].url)
    assert policy.choose(view(SYSTEM + "q" * 40), backends).backend is backends[0]


def test_a_prefix_still_in_flight_is_no_evidence_of_eviction() -> None:
    backends = fleet(1)
    b = backends[0]
    policy = TTFTPolicy()
    first = view(SYSTEM + " first question", 2010)
    second = view(SYSTEM + " second question", 2010)
    d1 = policy.choose(first, backends)
    d2 = policy.choose(second, backends)  # routed while the first is still prefilling
    assert d2.predicted_cached_tokens > 1900
    # the backend had nothing cached for the second (the first was not done): no trim
    policy.observe(Outcome(backend=b, view=second, decision=d2, ttft_s=0.1,
                           prompt_tokens=2010, cached_tokens=0))  # fmt: skip
    policy.observe(Outcome(backend=b, view=first, decision=d1, ttft_s=0.1,
                           prompt_tokens=2010, cached_tokens=0))  # fmt: skip
    assert policy.trims == 0 and policy.tree.limit(b.url) is None
    # once both are done, the prefix is confirmed: a later shortfall is an eviction
    d3 = policy.choose(view(SYSTEM + " third", 2005), backends)
    policy.observe(Outcome(backend=b, view=view(SYSTEM + " third", 2005), decision=d3,
                           ttft_s=0.1, prompt_tokens=2005, cached_tokens=0))  # fmt: skip
    assert policy.trims == 1


def test_a_cold_miss_avoids_the_backend_that_many_requests_are_flowing_to() -> None:
    backends = fleet(3)
    policy = TTFTPolicy()
    # Same decoding everywhere, b1 even has a little more prefill queued; but b0 has many
    # short cached requests in flight (a high arrival rate), b1 few: a long miss on b0 would
    # delay more of them.
    for b, in_flight, queued in zip(backends, (12, 2, 6), (100, 130, 100), strict=True):
        b.in_flight, b.in_prefill, b.in_flight_prefill_tokens = in_flight, in_flight - 2, queued
    for i in range(6):
        d = policy.choose(view(f"{i} a prompt no backend has seen " * 40), backends)
        assert d.backend is backends[1]
