"""An approximate radix tree of what each backend's prefix cache holds, over request text.

Like sgl-router's cache-aware tree, one tree is shared by all backends ("tenants"): each node has
an edge label (a run of characters), children keyed by their label's first character, and a map
tenant -> last-access stamp. A tenant owns every node on the path of each text inserted for it.

Memory is bounded by characters: the sum over tenants of the characters they own never exceeds
`max_chars` (the tree's own size is at most that). Beyond it, the least recently used
(node, tenant) leaf pair across *all* tenants is evicted first, mirroring the LRU leaf eviction
of SGLang's radix cache. A tenant can also have its own character limit (its estimated KV
capacity), enforced the same way within that tenant.

Theory of operation of the LRU: every insert stamps its whole path with a fresh tick and pushes
(tick, leaf) onto the tenant's heap. Heap entries are validated when popped (the stamp must be
current and the node still a leaf for that tenant), so refreshing a path costs no heap work; a
parent becomes evictable, and is pushed, when its last child carrying the tenant is evicted.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

DEFAULT_MAX_CHARS = 8 * 1024 * 1024


class _Node:
    __slots__ = ("children", "dead", "label", "parent", "tenants")

    def __init__(self, label: str, parent: _Node | None) -> None:
        self.label = label
        self.parent = parent
        self.children: dict[str, _Node] = {}
        self.tenants: dict[str, int] = {}
        self.dead = False

    def holds_in_child(self, tenant: str) -> bool:
        for child in self.children.values():
            if tenant in child.tenants:
                return True
        return False


def _common_prefix_len(label: str, text: str, pos: int) -> int:
    """Length of the common prefix of `label` and `text[pos:]` (C-speed comparisons)."""
    lo, hi = 0, min(len(label), len(text) - pos)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if text.startswith(label[:mid], pos):
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(slots=True)
class Match:
    """Characters of the text each tenant holds as a prefix, and its stamp at the deepest node."""

    chars: dict[str, int]
    stamps: dict[str, int]


class PrefixTree:
    def __init__(self, max_chars: int = DEFAULT_MAX_CHARS) -> None:
        if max_chars < 1:
            raise ValueError("max_chars must be >= 1")
        self.max_chars = max_chars
        self._root = _Node("", None)
        self._tick = itertools.count(1)
        self._seq = itertools.count()
        self._heaps: dict[str, list[tuple[int, int, _Node]]] = {}
        self._chars: dict[str, int] = {}
        self._limits: dict[str, int] = {}
        self._heap_live: dict[str, int] = {}
        self.total_chars = 0
        self.evicted_chars = 0

    # -- queries ---------------------------------------------------------------------------
    def match(self, text: str) -> Match:
        chars: dict[str, int] = {}
        stamps: dict[str, int] = {}
        node = self._root
        pos = 0
        n = len(text)
        while pos < n:
            child = node.children.get(text[pos])
            if child is None:
                break
            label = child.label
            full = text.startswith(label, pos)
            pos += len(label) if full else _common_prefix_len(label, text, pos)
            for tenant, stamp in child.tenants.items():
                chars[tenant] = pos
                stamps[tenant] = stamp
            if not full:
                break
            node = child
        return Match(chars, stamps)

    def tenant_chars(self, tenant: str) -> int:
        return self._chars.get(tenant, 0)

    def tenants(self) -> list[str]:
        return [t for t, c in self._chars.items() if c > 0]

    def limit(self, tenant: str) -> int | None:
        return self._limits.get(tenant)

    def node_count(self) -> int:
        return sum(1 for _ in self._walk(self._root)) - 1

    def _walk(self, node: _Node) -> Iterator[_Node]:
        stack = [node]
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    # -- updates ---------------------------------------------------------------------------
    def insert(self, text: str, tenant: str) -> int:
        """Record that `tenant` now holds `text` (and so every prefix of it); returns the
        stamp this insert put on the path (0 for an empty text)."""
        if not text:
            return 0
        stamp = next(self._tick)
        node = self._root
        pos = 0
        n = len(text)
        added = 0
        while pos < n:
            child = node.children.get(text[pos])
            if child is None:
                leaf = _Node(text[pos:], node)
                node.children[text[pos]] = leaf
                leaf.tenants[tenant] = stamp
                added += len(leaf.label)
                node = leaf
                break
            label = child.label
            if not text.startswith(label, pos):
                common = _common_prefix_len(label, text, pos)
                child = self._split(child, common)
                label = child.label
            if tenant not in child.tenants:
                added += len(label)
            child.tenants[tenant] = stamp
            pos += len(label)
            node = child
        self._chars[tenant] = self._chars.get(tenant, 0) + added
        self.total_chars += added
        self._push(tenant, stamp, node)
        limit = self._limits.get(tenant)
        if limit is not None and self._chars[tenant] > limit:
            self._evict_tenant(tenant, limit)
        if self.total_chars > self.max_chars:
            self._evict_global(self.max_chars)
        return stamp

    def _split(self, node: _Node, at: int) -> _Node:
        """Split `node`'s edge after `at` characters; return the new upper node."""
        assert 0 < at < len(node.label)
        parent = node.parent
        assert parent is not None
        upper = _Node(node.label[:at], parent)
        upper.tenants = dict(node.tenants)
        parent.children[upper.label[0]] = upper
        node.label = node.label[at:]
        node.parent = upper
        upper.children[node.label[0]] = node
        return upper

    def set_limit(self, tenant: str, max_chars: int | None) -> None:
        """Cap what one tenant may hold (its estimated cache size); None removes the cap."""
        if max_chars is None:
            self._limits.pop(tenant, None)
            return
        self._limits[tenant] = max(1, int(max_chars))
        if self._chars.get(tenant, 0) > self._limits[tenant]:
            self._evict_tenant(tenant, self._limits[tenant])

    def remove_tenant(self, tenant: str) -> None:
        """Forget everything a tenant holds (a backend that restarted has an empty cache)."""
        for node in list(self._walk(self._root)):
            if node is not self._root and tenant in node.tenants:
                del node.tenants[tenant]
        self._prune(self._root)
        self.total_chars -= self._chars.pop(tenant, 0)
        self._heaps.pop(tenant, None)

    def trim(self, text: str, tenant: str, keep_chars: int) -> int:
        """The tenant holds at most `keep_chars` of `text`: drop it from the path beyond that,
        and from everything below (an engine evicts leaves first, so nothing deeper survives).
        Returns the characters removed from the tenant."""
        node = self._root
        pos = 0
        while pos < len(text):
            child = node.children.get(text[pos])
            if child is None or tenant not in child.tenants:
                return 0
            end = pos + len(child.label)
            if end > keep_chars:
                if keep_chars > pos:
                    if not text.startswith(child.label[: keep_chars - pos], pos):
                        return 0
                    self._split(child, keep_chars - pos)  # `child` is now the part beyond
                return self._drop_subtree(child, tenant)
            if not text.startswith(child.label, pos):
                return 0
            pos = end
            node = child
        return 0

    def _drop_subtree(self, top: _Node, tenant: str) -> int:
        removed = 0
        for node in list(self._walk(top)):
            if tenant in node.tenants:
                del node.tenants[tenant]
                removed += len(node.label)
        self._chars[tenant] = self._chars.get(tenant, 0) - removed
        self.total_chars -= removed
        parent = top.parent
        self._prune(top)
        if parent is not None and parent is not self._root and tenant in parent.tenants:
            if not parent.holds_in_child(tenant):
                self._push(tenant, parent.tenants[tenant], parent)
        return removed

    def _prune(self, top: _Node) -> None:
        """Delete tenant-less nodes at and below `top` (iterative: paths can be deep)."""
        order = list(self._walk(top))
        for node in reversed(order):  # children before their parents
            if node is not self._root and not node.tenants and not node.children:
                parent = node.parent
                assert parent is not None
                if parent.children.get(node.label[0]) is node:
                    del parent.children[node.label[0]]
                node.dead = True

    # -- eviction --------------------------------------------------------------------------
    def _heap(self, tenant: str) -> list[tuple[int, int, _Node]]:
        heap = self._heaps.get(tenant)
        if heap is None:
            heap = self._heaps[tenant] = []
        return heap

    def _push(self, tenant: str, stamp: int, node: _Node) -> None:
        heap = self._heap(tenant)
        heapq.heappush(heap, (stamp, next(self._seq), node))
        if len(heap) > 4096 and len(heap) > 4 * self._heap_live.get(tenant, 0):
            # Mostly stale entries: rebuild from the tree's real leaves for this tenant.
            live = [
                (n.tenants[tenant], next(self._seq), n)
                for n in self._walk(self._root)
                if tenant in n.tenants and not n.holds_in_child(tenant)
            ]
            heapq.heapify(live)
            self._heaps[tenant] = live
            self._heap_live[tenant] = len(live)

    def _top(self, tenant: str) -> tuple[int, int, _Node] | None:
        """The tenant's least recently used leaf entry, discarding stale ones."""
        heap = self._heaps.get(tenant)
        while heap:
            stamp, _, node = heap[0]
            if node.dead or node.tenants.get(tenant) != stamp or node.holds_in_child(tenant):
                heapq.heappop(heap)
                continue
            return heap[0]
        return None

    def _evict_one(self, tenant: str) -> bool:
        entry = self._top(tenant)
        if entry is None:
            return False
        heapq.heappop(self._heaps[tenant])
        node = entry[2]
        del node.tenants[tenant]
        size = len(node.label)
        self._chars[tenant] -= size
        self.total_chars -= size
        self.evicted_chars += size
        parent = node.parent
        if not node.tenants and not node.children and parent is not None:
            del parent.children[node.label[0]]
            node.dead = True
        if parent is not None and parent is not self._root and tenant in parent.tenants:
            if not parent.holds_in_child(tenant):
                self._push(tenant, parent.tenants[tenant], parent)
        return True

    def _evict_tenant(self, tenant: str, target: int) -> None:
        while self._chars.get(tenant, 0) > target and self._evict_one(tenant):
            pass

    def _evict_global(self, target: int) -> None:
        while self.total_chars > target:
            oldest: tuple[int, str] | None = None
            for tenant in self._heaps:
                entry = self._top(tenant)
                if entry is not None and (oldest is None or entry[0] < oldest[0]):
                    oldest = (entry[0], tenant)
            if oldest is None or not self._evict_one(oldest[1]):
                return

    def __repr__(self) -> str:
        per = ", ".join(f"{t}={c}" for t, c in self._chars.items())
        return f"<PrefixTree {self.total_chars}/{self.max_chars} chars: {per}>"


__all__ = ["DEFAULT_MAX_CHARS", "Match", "PrefixTree"]
