"""Radix cache semantics: hit, partial hit, miss, split, paging, locking, LRU eviction."""

from __future__ import annotations

import pytest

from backends.sim.radix import RadixCache


def test_miss_then_full_and_partial_hit() -> None:
    cache = RadixCache()
    assert cache.match_prefix([1, 2, 3])[0] == 0
    present, _ = cache.insert([1, 2, 3, 4, 5])
    assert present == 0 and cache.total_size == 5
    assert cache.match_prefix([1, 2, 3, 4, 5, 6])[0] == 5
    assert cache.match_prefix([1, 2, 9])[0] == 2  # partial: ends mid-edge
    assert cache.match_prefix([7, 1, 2])[0] == 0


def test_insert_deduplicates_and_splits() -> None:
    cache = RadixCache()
    cache.insert([1, 2, 3, 4])
    present, node = cache.insert([1, 2, 7, 8])
    assert present == 2  # shared prefix [1, 2]
    assert cache.total_size == 6
    assert node.key == [7, 8]
    assert cache.match_prefix([1, 2, 3, 4])[0] == 4
    assert cache.match_prefix([1, 2, 7, 8])[0] == 4


def test_match_splits_edge_and_sizes_stay_consistent() -> None:
    cache = RadixCache()
    cache.insert(list(range(10)))
    length, node = cache.match_prefix([0, 1, 2, 3, 99])
    assert length == 4 and node.key == [0, 1, 2, 3]
    assert cache.total_size == 10 and cache.evictable_size == 10


def test_paging_caches_whole_pages_only() -> None:
    cache = RadixCache(page_size=4)
    present, _ = cache.insert(list(range(10)))  # 2 whole pages; 2-token tail not cached
    assert present == 0 and cache.total_size == 8
    assert cache.match_prefix(list(range(10)))[0] == 8
    assert cache.match_prefix([0, 1, 2, 3, 4, 5, 99, 7])[0] == 4  # mismatch inside page 2
    assert cache.match_prefix([0, 1, 2])[0] == 0  # less than a page


def test_lru_eviction_of_unlocked_leaves() -> None:
    cache = RadixCache()
    cache.insert([1, 1, 1])
    cache.insert([2, 2, 2])
    cache.insert([3, 3, 3])
    cache.match_prefix([1, 1, 1])  # refresh: 2 is now least recently used
    freed = cache.evict(3)
    assert freed == 3
    assert cache.match_prefix([2, 2, 2])[0] == 0
    assert cache.match_prefix([1, 1, 1])[0] == 3
    assert cache.match_prefix([3, 3, 3])[0] == 3


def test_locked_paths_are_never_evicted() -> None:
    cache = RadixCache()
    _, node = cache.insert([1, 2, 3])
    cache.insert([1, 2, 9, 9])  # shares [1, 2]
    cache.insert([5, 5])
    cache.inc_lock(node)  # locks [1, 2] and [3]
    assert cache.protected_size == 3
    freed = cache.evict(100)
    assert freed == 4  # [9, 9] and [5, 5]; the locked path stays
    assert cache.match_prefix([1, 2, 3])[0] == 3
    cache.dec_lock(node)
    assert cache.evictable_size == 3
    assert cache.evict(100) == 3 and cache.total_size == 0


def test_evict_parent_after_children() -> None:
    cache = RadixCache()
    cache.insert([1, 2, 3, 4])
    cache.insert([1, 2, 5, 6])
    assert cache.evict(6) == 6
    assert cache.total_size == 0


def test_bad_page_size() -> None:
    with pytest.raises(ValueError, match="page_size"):
        RadixCache(page_size=0)
