"""An approximate radix tree of what each backend's prefix cache holds, over request text.

Like sgl-router's cache-aware tree, one tree is shared by all backends ("tenants"): each node has
an edge label (a run of characters), children keyed by their label's first character, and for
each tenant holding it, a last-access stamp. A tenant owns every node on the path of each text
inserted for it, so what a tenant holds is closed under ancestors: a match walks the text's path
once and gives each tenant the depth of the deepest node it holds there.

Memory is bounded by characters: the sum over tenants of the characters they own never exceeds
`max_chars` (the tree's own size is at most that), and nodes never exceed `max_nodes`
(`max_chars // 32`: a node costs the same whatever its label's length). Beyond either, the
least recently used (node, tenant) leaf pair across *all* tenants is evicted first, mirroring
the LRU leaf eviction of SGLang's radix cache. A tenant can also have its own character limit
(its estimated KV capacity), enforced the same way within that tenant.

Theory of operation of the LRU: every insert stamps its whole path with a fresh tick and pushes
(tick, leaf) onto the tenant's heap. Heap entries are validated when popped (the stamp must be
current and the node still a leaf for that tenant), so refreshing a path costs no heap work; a
parent becomes evictable, and is pushed, when its last child carrying the tenant is evicted.

Layout, for the garbage collector: a node is an integer, never reused, and every field is a
dict from integers to strings or integers. CPython does not track such dicts, so a collection
never walks the tree. As objects (a node with its dicts, a heap entry referring to it), a full
tree was ~100k objects the collector tracked, and a full collection walked them for tens of
milliseconds while every request in flight waited (docs/benchmarks.md, "Seventh pass"). For the
same reason a heap entry is one integer, `stamp << 64 | node`, not a tuple.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

DEFAULT_MAX_CHARS = 8 * 1024 * 1024
CHARS_PER_NODE = 32
"""Nodes are bounded by `max_chars // CHARS_PER_NODE` (at least `MIN_NODES`) as well: a node
costs ~300 bytes whatever its label's length, and prompts that diverge at every character would
otherwise fill the character budget with one-character nodes."""
MIN_NODES = 1024
INSERT_SHARE = 8
"""A text is tracked up to `max_chars // INSERT_SHARE` characters (its start, where prefixes are
shared; at least `MIN_INSERT`): one prompt near the whole budget would otherwise push every
other entry out."""
MIN_INSERT = 64 * 1024
_ROOT = 0
_KEY_SHIFT = 21  # a child's key: its parent << 21 | its label's first code point (< 2**21)
_NODE_BITS = 64  # a heap entry: stamp << 64 | node
_NODE_MASK = (1 << _NODE_BITS) - 1


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
        self.max_nodes = max(MIN_NODES, max_chars // CHARS_PER_NODE)
        self.max_insert = max(max_chars // INSERT_SHARE, min(max_chars, MIN_INSERT))
        self._label: dict[int, str] = {_ROOT: ""}
        self._parent: dict[int, int] = {}
        self._child: dict[int, int] = {}  # parent << _KEY_SHIFT | ord(first char) -> child
        self._child_chars: dict[int, str] = {}  # node -> its children's first characters
        self._held: dict[str, dict[int, int]] = {}  # tenant -> {node: stamp}
        self._nodes = itertools.count(_ROOT + 1)
        self._tick = itertools.count(1)
        self._heaps: dict[str, list[int]] = {}
        self._chars: dict[str, int] = {}
        self._limits: dict[str, int] = {}
        self._heap_live: dict[str, int] = {}
        self.total_chars = 0
        self.evicted_chars = 0

    # -- queries ---------------------------------------------------------------------------
    def match(self, text: str) -> Match:
        path: list[int] = []  # the nodes the text runs through, the last perhaps partly
        ends: list[int] = []  # how far into the text each of them reaches
        child_of, labels = self._child, self._label
        node = _ROOT
        pos = 0
        n = len(text)
        while pos < n:
            child = child_of.get(node << _KEY_SHIFT | ord(text[pos]))
            if child is None:
                break
            label = labels[child]
            full = text.startswith(label, pos)
            pos += len(label) if full else _common_prefix_len(label, text, pos)
            path.append(child)
            ends.append(pos)
            if not full:
                break
            node = child
        chars: dict[str, int] = {}
        stamps: dict[str, int] = {}
        if path:
            for tenant, held in self._held.items():
                depth = 0
                for node in path:
                    if node not in held:
                        break
                    depth += 1
                if depth:
                    chars[tenant] = ends[depth - 1]
                    stamps[tenant] = held[path[depth - 1]]
        return Match(chars, stamps)

    def tenant_chars(self, tenant: str) -> int:
        return self._chars.get(tenant, 0)

    def tenants(self) -> list[str]:
        return [t for t, c in self._chars.items() if c > 0]

    def limit(self, tenant: str) -> int | None:
        return self._limits.get(tenant)

    def node_count(self) -> int:
        """Nodes in the tree, the root aside."""
        return len(self._label) - 1

    def _children(self, node: int) -> Iterator[int]:
        child_of, base = self._child, node << _KEY_SHIFT
        for char in self._child_chars.get(node, ""):
            yield child_of[base | ord(char)]

    def _walk(self, top: int) -> Iterator[int]:
        stack = [top]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(self._children(node))

    def _holds_in_child(self, node: int, tenant: str) -> bool:
        chars = self._child_chars.get(node)
        if chars is None:
            return False
        held = self._held.get(tenant, {})
        child_of, base = self._child, node << _KEY_SHIFT
        for char in chars:  # (a loop, not any(): this runs for every eviction)
            if child_of[base | ord(char)] in held:
                return True
        return False

    def _unheld(self, node: int) -> bool:
        for held in self._held.values():
            if node in held:
                return False
        return True

    # -- nodes -----------------------------------------------------------------------------
    def _new_node(self, parent: int, label: str) -> int:
        node = next(self._nodes)
        self._label[node] = label
        self._parent[node] = parent
        self._child[parent << _KEY_SHIFT | ord(label[0])] = node
        self._child_chars[parent] = self._child_chars.get(parent, "") + label[0]
        return node

    def _free_node(self, node: int) -> None:
        """Unlink a node that no tenant holds and that has no children."""
        parent = self._parent.pop(node)
        first = self._label.pop(node)[0]
        key = parent << _KEY_SHIFT | ord(first)
        if self._child.get(key) == node:
            del self._child[key]
            rest = self._child_chars[parent].replace(first, "", 1)
            if rest:
                self._child_chars[parent] = rest
            else:
                del self._child_chars[parent]

    # -- updates ---------------------------------------------------------------------------
    def insert(self, text: str, tenant: str) -> int:
        """Record that `tenant` now holds `text` (and so every prefix of it; of a text longer
        than `max_insert`, its first `max_insert` characters); returns the stamp this insert
        put on the path (0 for an empty text)."""
        if not text:
            return 0
        if len(text) > self.max_insert:
            text = text[: self.max_insert]
        stamp = next(self._tick)
        held = self._held.get(tenant)
        if held is None:
            held = self._held[tenant] = {}
        child_of, labels = self._child, self._label
        node = _ROOT
        pos = 0
        n = len(text)
        added = 0
        while pos < n:
            child = child_of.get(node << _KEY_SHIFT | ord(text[pos]))
            if child is None:
                node = self._new_node(node, text[pos:])
                held[node] = stamp
                added += n - pos
                break
            label = labels[child]
            if not text.startswith(label, pos):
                child = self._split(child, _common_prefix_len(label, text, pos))
                label = labels[child]
            if child not in held:
                added += len(label)
            held[child] = stamp
            pos += len(label)
            node = child
        self._chars[tenant] = self._chars.get(tenant, 0) + added
        self.total_chars += added
        self._push(tenant, stamp, node)
        limit = self._limits.get(tenant)
        if limit is not None and self._chars[tenant] > limit:
            self._evict_tenant(tenant, limit)
        if self.total_chars > self.max_chars or len(self._label) > self.max_nodes:
            self._evict_global(self.max_chars)
        return stamp

    def _split(self, node: int, at: int) -> int:
        """Split `node`'s edge after `at` characters; return the new upper node, which every
        tenant holding `node` holds too, with the same stamp."""
        label = self._label[node]
        assert 0 < at < len(label)
        parent = self._parent[node]
        upper = next(self._nodes)
        self._label[upper] = label[:at]
        self._parent[upper] = parent
        self._child[parent << _KEY_SHIFT | ord(label[0])] = upper  # in `node`'s place
        self._label[node] = label[at:]
        self._parent[node] = upper
        self._child[upper << _KEY_SHIFT | ord(label[at])] = node
        self._child_chars[upper] = label[at]
        for held in self._held.values():
            stamp = held.get(node)
            if stamp is not None:
                held[upper] = stamp
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
        """Forget everything a tenant holds (a backend that restarted has an empty cache).

        Costs what the tenant held, not the whole tree: it runs on the request path (a connect
        error in `ttft.observe`). A node no tenant holds any more has no child another tenant
        holds (what a tenant holds is closed under ancestors), so climbing from each of the
        tenant's nodes while they are unheld leaves frees them all, children first."""
        held = self._held.pop(tenant, None)
        self.total_chars -= self._chars.pop(tenant, 0)
        self._heaps.pop(tenant, None)
        self._heap_live.pop(tenant, None)
        if not held:
            return
        labels, child_chars = self._label, self._child_chars
        for node in held:
            while (
                node != _ROOT
                and node in labels  # not freed by an earlier climb
                and node not in child_chars
                and self._unheld(node)
            ):
                parent = self._parent[node]
                self._free_node(node)
                node = parent

    def trim(self, text: str, tenant: str, keep_chars: int) -> int:
        """The tenant holds at most `keep_chars` of `text`: drop it from the path beyond that,
        and from everything below (an engine evicts leaves first, so nothing deeper survives).
        Returns the characters removed from the tenant."""
        held = self._held.get(tenant, {})
        node = _ROOT
        pos = 0
        while pos < len(text):
            child = self._child.get(node << _KEY_SHIFT | ord(text[pos]))
            if child is None or child not in held:
                return 0
            label = self._label[child]
            end = pos + len(label)
            if end > keep_chars:
                if keep_chars > pos:
                    if not text.startswith(label[: keep_chars - pos], pos):
                        return 0
                    self._split(child, keep_chars - pos)  # `child` is now the part beyond
                return self._drop_subtree(child, tenant)
            if not text.startswith(label, pos):
                return 0
            pos = end
            node = child
        return 0

    def _drop_subtree(self, top: int, tenant: str) -> int:
        held = self._held[tenant]
        removed = 0
        for node in list(self._walk(top)):
            if held.pop(node, None) is not None:
                removed += len(self._label[node])
        self._chars[tenant] = self._chars.get(tenant, 0) - removed
        self.total_chars -= removed
        parent = self._parent[top]
        self._prune(top)
        if parent != _ROOT and parent in held and not self._holds_in_child(parent, tenant):
            self._push(tenant, held[parent], parent)
        return removed

    def _prune(self, top: int) -> None:
        """Free the nodes at and below `top` that no tenant holds (iterative: paths can be
        deep)."""
        order = list(self._walk(top))
        for node in reversed(order):  # children before their parents
            if node != _ROOT and node not in self._child_chars and self._unheld(node):
                self._free_node(node)

    # -- eviction --------------------------------------------------------------------------
    def _push(self, tenant: str, stamp: int, node: int) -> None:
        heap = self._heaps.get(tenant)
        if heap is None:
            heap = self._heaps[tenant] = []
        heapq.heappush(heap, stamp << _NODE_BITS | node)
        if len(heap) > 4096 and len(heap) > 4 * self._heap_live.get(tenant, 0):
            # Mostly stale entries: rebuild from the tenant's real leaves.
            held = self._held[tenant]
            live = [
                held_stamp << _NODE_BITS | n
                for n, held_stamp in held.items()
                if not self._holds_in_child(n, tenant)
            ]
            heapq.heapify(live)
            self._heaps[tenant] = live
            self._heap_live[tenant] = len(live)

    def _top(self, tenant: str) -> int | None:
        """The tenant's least recently used leaf, as its heap entry, discarding stale entries:
        a node freed or refreshed since, or no longer the tenant's leaf."""
        heap = self._heaps.get(tenant)
        held = self._held.get(tenant, {})
        while heap:
            entry = heap[0]
            node = entry & _NODE_MASK
            if held.get(node) == entry >> _NODE_BITS and not self._holds_in_child(node, tenant):
                return entry
            heapq.heappop(heap)
        return None

    def _evict_top(self, tenant: str, entry: int) -> None:
        """Evict the leaf of the tenant's top heap entry, `entry` (as `_top` returned it)."""
        heapq.heappop(self._heaps[tenant])
        node = entry & _NODE_MASK
        held = self._held[tenant]
        del held[node]
        size = len(self._label[node])
        self._chars[tenant] -= size
        self.total_chars -= size
        self.evicted_chars += size
        parent = self._parent[node]
        if node not in self._child_chars and self._unheld(node):
            self._free_node(node)
        if parent != _ROOT and parent in held and not self._holds_in_child(parent, tenant):
            self._push(tenant, held[parent], parent)

    def _evict_tenant(self, tenant: str, target: int) -> None:
        while self._chars.get(tenant, 0) > target:
            entry = self._top(tenant)
            if entry is None:
                return
            self._evict_top(tenant, entry)

    def _evict_global(self, target: int) -> None:
        # An eviction changes only its own tenant's heap: the other tenants' tops stand.
        tops: dict[str, int] = {}
        for tenant in self._heaps:
            entry = self._top(tenant)
            if entry is not None:
                tops[tenant] = entry
        while (self.total_chars > target or len(self._label) > self.max_nodes) and tops:
            tenant = min(tops, key=tops.__getitem__)  # the oldest stamp of all
            self._evict_top(tenant, tops[tenant])
            entry = self._top(tenant)
            if entry is None:
                del tops[tenant]
            else:
                tops[tenant] = entry

    def __repr__(self) -> str:
        per = ", ".join(f"{t}={c}" for t, c in self._chars.items())
        return f"<PrefixTree {self.total_chars}/{self.max_chars} chars: {per}>"


__all__ = ["DEFAULT_MAX_CHARS", "Match", "PrefixTree"]
