"""A radix tree over token ids: SGLang's RadixAttention prefix cache, without the GPU.

Semantics follow `sglang/srt/mem_cache/radix_cache.py`:
- keys are token ids, matched page by page (`page_size`); only whole pages are cached;
- `match_prefix` returns the longest cached prefix and splits an edge that ends mid-way;
- `insert` adds a sequence and reports how much of it was already present (deduplicated);
- nodes on the path of an in-flight request are locked (`inc_lock`/`dec_lock`) and never evicted;
- `evict(n)` removes unlocked leaves, least recently used first, until n tokens are freed.
Values (KV-pool slots) are not modelled; only token counts are, which is all the scheduler needs.

With an `events` sink, the tree reports its changes as SGLang's KV-cache events do (wire form,
`backends.kv_events`): `BlockStored` for each new node's pages, `BlockRemoved` for the pages of
evicted nodes, `AllBlocksCleared` on reset. A page's hash chains its parent's (splits keep them).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from typing import Any

Key = int | tuple[int, ...]


class Node:
    __slots__ = ("children", "hashes", "key", "last_access", "lock_ref", "parent", "uid")

    def __init__(self, key: list[int], parent: Node | None, uid: int) -> None:
        self.children: dict[Key, Node] = {}
        self.key = key
        self.parent = parent
        self.lock_ref = 0
        self.last_access = 0
        self.uid = uid
        self.hashes: list[int] = []
        """One per page of `key`, when the tree reports events."""

    def __repr__(self) -> str:
        return f"Node(len={len(self.key)}, lock={self.lock_ref}, children={len(self.children)})"


class RadixCache:
    def __init__(
        self, page_size: int = 1, *, events: Callable[[list[list[Any]]], None] | None = None
    ) -> None:
        if page_size < 1:
            raise ValueError("page_size must be >= 1")
        self.page_size = page_size
        self._uids = itertools.count()
        self._tick = 0
        self._events: Callable[[list[list[Any]]], None] | None = None
        self.reset()
        self._events = events

    def reset(self) -> None:
        """Drop everything (SGLang's /flush_cache). Callers make sure nothing is locked."""
        if self._events is not None:
            self._events([["AllBlocksCleared"]])
        self.root = Node([], None, next(self._uids))
        self.root.lock_ref = 1  # the root is never evicted
        self.total_size = 0
        """Tokens held by the tree."""
        self.evictable_size = 0
        """Tokens in nodes no running request has locked."""

    # -- lookups -------------------------------------------------------------------------------

    def _head(self, key: Sequence[int], start: int) -> Key:
        if self.page_size == 1:
            return key[start]
        return tuple(key[start : start + self.page_size])

    def _aligned(self, length: int) -> int:
        return length - length % self.page_size

    def _common(self, edge: list[int], key: Sequence[int], start: int, end: int) -> int:
        """Length of the common prefix of `edge` and key[start:end], rounded down to pages."""
        n = min(len(edge), end - start)
        if key[start : start + n] == edge[:n]:
            return self._aligned(n)
        i = 0
        while i < n and edge[i] == key[start + i]:
            i += 1
        return self._aligned(i)

    def _touch(self) -> int:
        self._tick += 1
        return self._tick

    def match_prefix(self, key: Sequence[int]) -> tuple[int, Node]:
        """Longest cached prefix of `key`: (length, deepest node). Refreshes access times."""
        end = self._aligned(len(key))
        tick = self._touch()
        node, pos = self.root, 0
        while pos < end:
            child = node.children.get(self._head(key, pos))
            if child is None:
                break
            child.last_access = tick
            matched = self._common(child.key, key, pos, end)
            if matched < len(child.key):
                node = self._split(child, matched)
                pos += matched
                break
            node, pos = child, pos + matched
        return pos, node

    def _split(self, child: Node, at: int) -> Node:
        """Cut `child`'s edge after `at` tokens; returns the new upper node."""
        parent = child.parent
        assert parent is not None and 0 < at < len(child.key)
        upper = Node(child.key[:at], parent, next(self._uids))
        pages = at // self.page_size
        upper.hashes, child.hashes = child.hashes[:pages], child.hashes[pages:]
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        parent.children[self._head(child.key, 0)] = upper
        child.key = child.key[at:]
        child.parent = upper
        upper.children[self._head(child.key, 0)] = child
        return upper

    # -- updates -------------------------------------------------------------------------------

    def insert(self, key: Sequence[int]) -> tuple[int, Node]:
        """Insert the page-aligned part of `key`: (tokens already present, deepest node)."""
        end = self._aligned(len(key))
        tick = self._touch()
        node, pos = self.root, 0
        while pos < end:
            head = self._head(key, pos)
            child = node.children.get(head)
            if child is None:
                new = Node(list(key[pos:end]), node, next(self._uids))
                new.last_access = tick
                node.children[head] = new
                if self._events is not None:
                    self._stored(new)
                added = end - pos
                self.total_size += added
                self.evictable_size += added
                return pos, new
            child.last_access = tick
            matched = self._common(child.key, key, pos, end)
            if matched < len(child.key):
                child = self._split(child, matched)
            node, pos = child, pos + matched
        return pos, node

    def inc_lock(self, node: Node) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.key)
            node.lock_ref += 1
            assert node.parent is not None
            node = node.parent

    def dec_lock(self, node: Node) -> None:
        while node is not self.root:
            assert node.lock_ref > 0, "unbalanced dec_lock"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_size += len(node.key)
            assert node.parent is not None
            node = node.parent

    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` if possible, least recently used unlocked leaves first."""
        heap = [(n.last_access, n.uid, n) for n in self._nodes() if self._evictable_leaf(n)]
        heapq.heapify(heap)
        freed = 0
        removed: list[int] = []
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            assert parent is not None
            del parent.children[self._head(node.key, 0)]
            removed += node.hashes
            freed += len(node.key)
            self.total_size -= len(node.key)
            self.evictable_size -= len(node.key)
            if self._evictable_leaf(parent):
                heapq.heappush(heap, (parent.last_access, parent.uid, parent))
        if removed and self._events is not None:
            self._events([["BlockRemoved", removed]])
        return freed

    def _stored(self, node: Node) -> None:
        assert node.parent is not None
        size = self.page_size
        parent = node.parent.hashes[-1] if node.parent.hashes else None
        previous = parent
        for start in range(0, len(node.key), size):
            previous = hash((previous, tuple(node.key[start : start + size]))) & (2**63 - 1)
            node.hashes.append(previous)
        assert self._events is not None
        self._events([["BlockStored", node.hashes, parent, node.key, size, None]])

    def _evictable_leaf(self, node: Node) -> bool:
        return node is not self.root and not node.children and node.lock_ref == 0

    def _nodes(self) -> list[Node]:
        out: list[Node] = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    @property
    def protected_size(self) -> int:
        return self.total_size - self.evictable_size

    def __repr__(self) -> str:
        return (
            f"RadixCache(total={self.total_size}, evictable={self.evictable_size}, "
            f"page_size={self.page_size})"
        )
