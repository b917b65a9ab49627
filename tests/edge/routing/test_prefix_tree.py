"""The approximate radix tree: matching, splitting, LRU eviction under a character budget, trims."""

from __future__ import annotations

import gc
import itertools
import random
from collections.abc import Iterator

import pytest

from edge.routing.prefix_tree import PrefixTree


def test_match_counts_characters_per_tenant() -> None:
    tree = PrefixTree()
    tree.insert("system prompt: be brief. question one", "a")
    tree.insert("system prompt: be brief. question two", "b")
    tree.insert("other text", "c")
    m = tree.match("system prompt: be brief. question one, again")
    assert m.chars == {
        "a": len("system prompt: be brief. question one"),
        "b": len("system prompt: be brief. question "),
    }
    assert tree.match("nothing shared").chars == {}
    assert tree.match("").chars == {}
    assert tree.match("syst").chars == {"a": 4, "b": 4}
    # the tenants own exactly the characters they inserted
    assert tree.tenant_chars("a") == len("system prompt: be brief. question one")
    assert tree.tenant_chars("c") == len("other text")
    assert tree.total_chars == sum(tree.tenant_chars(t) for t in "abc")


def test_split_keeps_both_branches() -> None:
    tree = PrefixTree()
    tree.insert("abcdef", "a")
    tree.insert("abcxyz", "a")
    tree.insert("ab", "b")
    assert tree.match("abcdef").chars == {"a": 6, "b": 2}
    assert tree.match("abcxyz").chars == {"a": 6, "b": 2}
    assert tree.tenant_chars("a") == len("abcdefxyz")
    assert tree.node_count() == 4  # ab, c, def, xyz


def test_stamps_reflect_recency() -> None:
    tree = PrefixTree()
    tree.insert("shared prefix A", "a")
    tree.insert("shared prefix B", "b")
    m = tree.match("shared prefix")
    assert m.stamps["b"] > m.stamps["a"]
    tree.insert("shared prefix A", "a")
    assert tree.match("shared prefix").stamps["a"] > tree.match("shared prefix").stamps["b"]


def test_global_budget_evicts_least_recently_used_across_tenants() -> None:
    tree = PrefixTree(max_chars=100)
    tree.insert("x" * 40, "a")  # oldest
    tree.insert("y" * 40, "b")
    tree.insert("z" * 40, "a")  # over budget: the x-run goes
    assert tree.total_chars == 80 <= tree.max_chars
    assert tree.match("x" * 40).chars == {}
    assert tree.match("y" * 40).chars == {"b": 40}
    tree.insert("y" * 40, "b")  # refresh: now the z-run is the oldest
    tree.insert("w" * 30, "c")
    assert tree.match("z" * 40).chars == {}
    assert tree.match("y" * 40).chars == {"b": 40}
    assert tree.evicted_chars == 80


def test_eviction_takes_leaves_first() -> None:
    tree = PrefixTree(max_chars=60)
    tree.insert("P" * 30 + "one", "a")
    tree.insert("P" * 30 + "two", "a")
    tree.insert("q" * 25, "b")  # 36 + 25 = 61 > 60: the oldest leaf "one" goes, not the prefix
    assert tree.match("P" * 30 + "one").chars == {"a": 30}
    assert tree.match("P" * 30 + "two").chars == {"a": 33}


def test_per_tenant_limit() -> None:
    tree = PrefixTree()
    tree.set_limit("a", 50)
    for i in range(10):
        tree.insert(chr(65 + i) + "k" * 19, "a")  # ten disjoint 20-char texts
        tree.insert(chr(65 + i) + "k" * 19, "b")
    assert tree.tenant_chars("a") <= 50
    assert tree.tenant_chars("b") == 200
    assert tree.match("J" + "k" * 19).chars == {"a": 20, "b": 20}  # the newest survive
    assert "a" not in tree.match("A" + "k" * 19).chars
    tree.set_limit("a", None)
    assert tree.limit("a") is None


def test_trim_drops_the_path_below_and_everything_under_it() -> None:
    tree = PrefixTree()
    base = "S" * 100
    tree.insert(base + "first question", "a")
    tree.insert(base + "second question", "a")
    tree.insert(base + "first question", "b")
    removed = tree.trim(base + "first question", "a", keep_chars=60)
    assert removed == 100 + len("first question") + len("second question") - 60
    assert tree.match(base + "second question").chars == {"a": 60, "b": 100}
    assert tree.match(base + "first question").chars == {"a": 60, "b": 114}
    assert tree.tenant_chars("a") == 60
    assert tree.trim("unknown", "a", 0) == 0
    assert tree.trim(base, "c", 10) == 0


def test_remove_tenant() -> None:
    tree = PrefixTree()
    tree.insert("shared start a", "a")
    tree.insert("shared start b", "b")
    tree.remove_tenant("a")
    assert tree.match("shared start a").chars == {"b": len("shared start ")}
    assert tree.tenant_chars("a") == 0 and tree.total_chars == len("shared start b")
    tree.insert("shared start a", "a")
    assert tree.match("shared start a").chars["a"] == 14


def test_bad_budget() -> None:
    with pytest.raises(ValueError):
        PrefixTree(max_chars=0)


def test_random_workload_matches_a_brute_force_model() -> None:
    """Without eviction, each tenant's match is its longest common prefix with what it got."""
    rng = random.Random(7)
    alphabet = "abc"
    tree = PrefixTree(max_chars=10**9)
    inserted: dict[str, list[str]] = {"t1": [], "t2": [], "t3": []}
    for _ in range(400):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 12)))
        tenant = rng.choice(list(inserted))
        tree.insert(text, tenant)
        inserted[tenant].append(text)
    for _ in range(300):
        query = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 14)))
        expected = {}
        for tenant, texts in inserted.items():
            best = max((common(query, t) for t in texts), default=0)
            if best:
                expected[tenant] = best
        assert tree.match(query).chars == expected, query


def test_memory_stays_bounded_under_churn() -> None:
    rng = random.Random(3)
    tree = PrefixTree(max_chars=5000)
    for i in range(3000):
        prefix = f"group{rng.randint(0, 40)}:" + "p" * 50
        tree.insert(prefix + f"q{i}" + "x" * rng.randint(0, 80), f"t{i % 4}")
        assert tree.total_chars <= 5000
    assert tree.total_chars == sum(tree.tenant_chars(f"t{i}") for i in range(4))
    # nodes cannot outnumber characters, and the lazy heaps are compacted
    assert tree.node_count() <= 5000
    assert all(len(h) < 20000 for h in tree._heaps.values())


def test_holdings_stay_consistent_under_eviction_trims_and_removals() -> None:
    """After every operation: each node lies on its parent's path, what a tenant holds is
    closed under ancestors, the character counts add up, and no node is left unheld."""
    rng = random.Random(11)
    tree = PrefixTree(max_chars=400)
    texts: list[str] = []
    for _ in range(2000):
        tenant = rng.choice(["t1", "t2", "t3"])
        roll = rng.random()
        if roll < 0.7 or not texts:
            stem = rng.choice(texts)[: rng.randint(0, 30)] if texts else ""
            texts.append(stem + "".join(rng.choice("abcd") for _ in range(rng.randint(1, 20))))
            tree.insert(texts[-1], tenant)
        elif roll < 0.85:
            text = rng.choice(texts)
            tree.trim(text, tenant, rng.randint(0, len(text)))
        elif roll < 0.97:
            tree.set_limit(tenant, rng.choice([None, 50, 150]))
        else:
            tree.remove_tenant(tenant)
        check_invariants(tree)
    assert tree.evicted_chars > 0


def check_invariants(tree: PrefixTree) -> None:
    nodes = list(tree._walk(0))[1:]
    assert len(nodes) == tree.node_count()
    for node in nodes:
        assert any(node in held for held in tree._held.values()), "an unheld node survived"
    for tenant, held in tree._held.items():
        for node in held:
            parent = tree._parent[node]
            assert parent == 0 or parent in held, "a tenant holds a node but not its parent"
        assert tree.tenant_chars(tenant) == sum(len(tree._label[n]) for n in held)
    assert tree.total_chars == sum(tree.tenant_chars(t) for t in tree._held)
    assert tree.total_chars <= tree.max_chars


def test_the_garbage_collector_does_not_walk_the_tree() -> None:
    """A full collection stops every request in flight for as long as it walks the objects it
    tracks: the tree must not add to them as it grows (nodes, labels, stamps, heap entries)."""

    def tracked(tree: PrefixTree) -> int:
        gc.collect()
        seen: set[int] = set()
        stack: list[object] = [tree]
        while stack:
            obj = stack.pop()
            if id(obj) in seen or not gc.is_tracked(obj) or isinstance(obj, type):
                continue  # (a type leads to its module, and from there to everything)
            seen.add(id(obj))
            stack.extend(gc.get_referents(obj))
        return len(seen)

    def grown(texts: int) -> PrefixTree:
        rng = random.Random(5)
        tree = PrefixTree(max_chars=20_000)
        for i in range(texts):
            text = "".join(rng.choice("abcd") for _ in range(rng.randint(10, 60)))
            tree.insert(text, f"t{i % 3}")
            if i % 7 == 0:
                tree.trim(text, f"t{i % 3}", rng.randint(0, len(text)))
        return tree

    small, large = grown(20), grown(3000)
    assert large.node_count() > 20 * small.node_count() and large.evicted_chars > 0
    assert tracked(large) == tracked(small)


def common(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def test_nodes_stay_bounded_when_prompts_diverge_at_every_character() -> None:
    """A node costs ~300 bytes whatever its label's length: prompts that diverge at every
    character (every string of up to 4 letters of 16) would fill a tree of `max_chars`
    characters with as many nodes (8 Mi characters: ~2.4 GB). Nodes are bounded too, by
    `max_chars // 32`, evicted in the same LRU order."""
    tree = PrefixTree(max_chars=1 << 20)
    alphabet = "abcdefghijklmnop"
    for k in range(1, 5):
        for letters in itertools.product(alphabet, repeat=k):
            tree.insert("".join(letters), f"t{len(letters) % 2}")
    assert tree.node_count() <= (1 << 20) // 32
    check_invariants(tree)
    # the most recent survive: the last strings inserted are still matched whole
    assert tree.match("pppp").chars == {"t0": 4}


def test_forgetting_a_backend_costs_what_it_held_not_the_whole_tree() -> None:
    """`remove_tenant` runs on the request path (`ttft.observe` of a connect error: a backend
    that went down). Walking the whole tree there held the event loop for tens of ms on a full
    tree (28k nodes: 27 ms), for each such error, even once the backend held nothing."""
    rng = random.Random(5)
    tree = PrefixTree()
    for i in range(2000):
        tenant = "big" if i % 20 else "small"
        tree.insert(f"{i % 50:02d}" + "".join(rng.choice("abcd") for _ in range(60)), tenant)
    visited = 0
    walk = tree._walk

    def counting(top: int) -> Iterator[int]:
        nonlocal visited
        for node in walk(top):
            visited += 1
            yield node

    tree._walk = counting  # type: ignore[method-assign]
    small = len(tree._held["small"])
    tree.remove_tenant("small")
    assert visited <= small, (visited, small, tree.node_count())
    check_invariants(tree)
    visited = 0
    tree.remove_tenant("small")  # holds nothing now
    tree.remove_tenant("never seen")
    assert visited == 0
    tree._walk = walk  # type: ignore[method-assign]
    check_invariants(tree)
    assert tree.match("00").chars.get("small") is None


def test_one_huge_prompt_does_not_push_everything_else_out_of_the_tree() -> None:
    """The tree is inserted into before the request is sent: one prompt near the whole budget
    (a client's 8 MB body, which a backend may well refuse as too long) evicted every other
    backend's holdings to make room, and routing went blind until it learned them again. A
    text is tracked up to `max_chars // 8` characters: its start, where prefixes are shared."""
    tree = PrefixTree(max_chars=1 << 20)
    rng = random.Random(9)
    prompts = ["".join(rng.choice("abcdefgh") for _ in range(4000)) for _ in range(100)]
    for i, prompt in enumerate(prompts):
        tree.insert(prompt, f"b{i % 3}")
    huge = "z" * (1 << 20)
    tree.insert(huge, "b0")
    assert tree.match(huge).chars == {"b0": (1 << 20) // 8}
    kept = sum(1 for i, p in enumerate(prompts) if tree.match(p).chars.get(f"b{i % 3}") == len(p))
    assert kept >= 60, kept
    check_invariants(tree)
