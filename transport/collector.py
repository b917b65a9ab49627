"""The garbage collector's settings for a serving process (`prepare_collector`).

A collection runs on the event loop's thread, so every request in flight waits it out; these
settings keep collections rare and short while serving (the `quicedge_gc_pause_seconds` row of
docs/transport.md, "Metrics", gives the measured effect).
"""

from __future__ import annotations

import gc

# CPython starts a young collection when tracked allocations have outnumbered deallocations by
# this much since the last one (700 by default). Serving frees nearly all it allocates, but the
# requests in flight hold ~50 tracked objects each until they end, so at 32 streams the count
# crossed 700 about every 30 requests: a 0.3 ms stop of every request, finding nothing to free.
# At 10,000 a steady load runs almost none; real garbage still triggers one. Nothing long-lived
# piles up in the young generation meanwhile: the prefix tree, the one structure that grows with
# traffic, is not tracked at all (edge/routing/prefix_tree.py).
YOUNG_COLLECTION_THRESHOLD = 10_000


def prepare_collector() -> None:
    """Ready the garbage collector for serving. Everything allocated at startup (modules,
    classes, config: ~60k objects) moves out of its reach: a full collection walks every
    tracked object, ~75 ms here with them, a pause every request in flight would wait out;
    after the freeze, a full collection walks only what serving allocated. And young
    collections start at `YOUNG_COLLECTION_THRESHOLD`."""
    gc.collect()
    gc.freeze()
    _, middle, full = gc.get_threshold()
    gc.set_threshold(YOUNG_COLLECTION_THRESHOLD, middle, full)


__all__ = ["YOUNG_COLLECTION_THRESHOLD", "prepare_collector"]
