"""What the shared routing view's mirror costs per placed block once a backend's list is full.

    python -m tools.fleet_view_cpu [--cap 65536] [--requests 2000] [--blocks 16] [--seed 0]

`FleetView.placed` appends a request's block hashes to the backend's recency order and, past
`max_blocks_per_backend` (65,536 by default; it applies until `/v1/loads` tells the backend's
KV pool, and to pools larger than it), drops the oldest. This bench fills one backend's list to
`--cap`, then places `--requests` requests of `--blocks` fresh hashes each (the worst case:
every hash new, every one evicting one) and prints the time per placed hash and per request
(its untold list is full too, as while Redis is away, so two lists drop their oldest per hash),
the same for the entries other processes publish (`_apply`, one list), and the memory one full
backend takes (its list and its told-when map). It asserts nothing: timings on a shared VM
vary by tens of percent between runs.
"""

from __future__ import annotations

import argparse
import random
import time
import tracemalloc

import orjson

from edge.routing.fleet_view import FleetView, FleetViewConfig

_URL = "http://b0"


def _view(cap: int) -> FleetView:
    view = FleetView(
        FleetViewConfig(enabled=True, max_blocks_per_backend=cap),
        url="redis://127.0.0.1:1/0",
        backends=[],
    )
    return view


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cap", type=int, default=65536)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    batches = [[rng.getrandbits(63) for _ in range(args.blocks)] for _ in range(args.requests)]
    hashes = args.requests * args.blocks

    view = _view(args.cap)
    view.placed(_URL, range(-args.cap, 0))  # full, as after a while of traffic
    started = time.perf_counter()
    for batch in batches:
        view.placed(_URL, batch)
    local = time.perf_counter() - started

    view = _view(args.cap)
    view.placed(_URL, range(-args.cap, 0))
    entries = [orjson.dumps({"i": "other", "placed": {_URL: batch}}) for batch in batches]
    started = time.perf_counter()
    for raw in entries:
        view._apply(raw, {_URL})
    remote = time.perf_counter() - started

    tracemalloc.start()
    view = _view(args.cap)
    view.placed(_URL, range(-args.cap, 0))
    view._batch()  # pending told: the list and the told-when map are both full
    memory, _peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()

    print(f"cap {args.cap}, {args.requests} requests of {args.blocks} new blocks each")
    print(f"one backend's full mirror and told-when map: {memory / 2**20:.1f} MiB")
    for name, took in (("placed (this process)", local), ("_apply (other processes)", remote)):
        print(
            f"{name:26} {took / hashes * 1e6:8.2f} us/hash"
            f" {took / args.requests * 1e3:8.3f} ms/request"
        )


if __name__ == "__main__":
    main()
