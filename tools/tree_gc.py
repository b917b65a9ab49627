"""What the routing policy's prefix tree costs the garbage collector, and the edge per request.

    python -m tools.tree_gc [--requests 40000] [--max-chars 8388608] [--tenants 4] [--seed 0] \\
        [--json PATH] [--instructions]

Every garbage collection stops the event loop, so every request in flight waits it out, and a
full collection walks every object the collector tracks. The prefix tree is the one structure
in the edge that grows with traffic (up to `--max-chars` of learned text, 8 MiB by default),
so it sets how long a full collection takes once the edge has served a while. This bench feeds
one tree, in one process, what the `ttft` policy feeds it per request: a match of the prompt,
an insert of the prompt for the chosen backend, and an insert of prompt + answer when the
answer ends. Prompts are a shared system prompt (one of `--groups`), then a question of their
own; answers are `--answer-chars` long; words come from a fixed vocabulary, seeded.

It reports, for the whole run and for its last quarter (the tree full, evicting), the
collections by generation and their pauses (median and longest), the objects the collector
tracks because of the tree, the time of one full collection at the end, and the tree's own
time per request. It asserts nothing: speed belongs in reports. Time per request on a shared VM
varies by ±30 % between identical runs; `--instructions` counts instead (valgrind must be
installed): it runs this bench under cachegrind twice with the same texts, once feeding the tree
and once not (`--no-tree`), and reports the difference per request. `--json` also writes the
results with the command that produced them (`command`).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from edge.routing.prefix_tree import DEFAULT_MAX_CHARS, PrefixTree
from tools.cachegrind import instructions
from transport.gc_pauses import GcPauseProbe


class _Pauses:
    """The histogram `GcPauseProbe` observes into, kept as plain lists per generation."""

    def __init__(self) -> None:
        self.by_generation: dict[str, list[float]] = {"0": [], "1": [], "2": []}

    def labels(self, *values: str) -> _Series:
        (generation,) = values
        return _Series(self.by_generation[generation])


class _Series:
    def __init__(self, values: list[float]) -> None:
        self.values = values

    def observe(self, value: float) -> None:
        self.values.append(value)


def _words(rng: random.Random, vocabulary: list[str], chars: int) -> str:
    out: list[str] = []
    length = 0
    while length < chars:
        word = rng.choice(vocabulary)
        out.append(word)
        length += len(word) + 1
    return " ".join(out)


def _summary(pauses: dict[str, list[float]], requests: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for generation, values in pauses.items():
        out[generation] = {
            "collections": len(values),
            "per_1k_requests": 1000 * len(values) / max(1, requests),
            "median_ms": statistics.median(values) * 1e3 if values else None,
            "max_ms": max(values) * 1e3 if values else None,
            "total_ms": sum(values) * 1e3,
        }
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    vocabulary = [
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
        for _ in range(5000)
    ]
    systems = [_words(rng, vocabulary, args.system_chars) for _ in range(args.groups)]
    tenants = [f"http://10.0.0.{i + 1}:30000" for i in range(args.tenants)]
    feed = not args.no_tree

    gc.collect()
    gc.freeze()  # as `serve` does: what existed before the tree is not walked
    tracked_before = len(gc.get_objects())
    tree = PrefixTree(args.max_chars)
    pauses = _Pauses()
    probe = GcPauseProbe(pauses)
    last_quarter_from = args.requests - args.requests // 4
    marks: dict[str, int] = {}
    tree_s = 0.0
    probe.start()
    try:
        for i in range(args.requests):
            if i == last_quarter_from:
                marks = {g: len(v) for g, v in pauses.by_generation.items()}
            prompt = rng.choice(systems) + " " + _words(rng, vocabulary, args.question_chars)
            answer = _words(rng, vocabulary, args.answer_chars)
            start = time.perf_counter()
            chars = tree.match(prompt).chars if feed else {}
            tenant = max(tenants, key=lambda t: chars.get(t, 0) - rng.random())
            if feed:
                tree.insert(prompt, tenant)
                tree.insert(prompt + answer, tenant)
            tree_s += time.perf_counter() - start
    finally:
        probe.stop()
    gc.collect()
    tracked = len(gc.get_objects()) - tracked_before
    full_ms = []
    for _ in range(5):
        start = time.perf_counter()
        gc.collect()
        full_ms.append((time.perf_counter() - start) * 1e3)
    gc.unfreeze()
    last = {g: v[marks.get(g, 0) :] for g, v in pauses.by_generation.items()}
    return {
        "requests": args.requests,
        "max_chars": args.max_chars,
        "tree_chars": tree.total_chars,
        "evicted_chars": tree.evicted_chars,
        "nodes": tree.node_count(),
        "tracked_objects": tracked,
        "full_collection_ms": statistics.median(full_ms),
        "tree_us_per_request": tree_s / args.requests * 1e6,
        "collections": _summary(pauses.by_generation, args.requests),
        "collections_last_quarter": _summary(last, args.requests // 4),
    }


def report(r: dict[str, Any]) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    lines = [
        f"{r['requests']} requests; tree {r['tree_chars']:,} of {r['max_chars']:,} chars"
        f" ({r['nodes']:,} nodes, {r['evicted_chars']:,} chars evicted)",
        f"objects the collector tracks for the tree: {r['tracked_objects']:,}",
        f"one full collection at the end: {r['full_collection_ms']:.2f} ms",
        f"tree work per request (match + 2 inserts): {r['tree_us_per_request']:.1f} us",
        "",
        "| part | generation | collections | per 1k requests | median ms | longest ms | total ms |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for part, key in (("whole run", "collections"), ("last quarter", "collections_last_quarter")):
        for generation, s in r[key].items():
            lines.append(
                f"| {part} | {generation} | {s['collections']} | {s['per_1k_requests']:.1f}"
                f" | {ms(s['median_ms'])} | {ms(s['max_ms'])} | {s['total_ms']:.1f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.tree_gc", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--requests", type=int, default=40000)
    p.add_argument("--max-chars", type=int, default=DEFAULT_MAX_CHARS)
    p.add_argument("--tenants", type=int, default=4)
    p.add_argument("--groups", type=int, default=64, help="shared system prompts")
    p.add_argument("--system-chars", type=int, default=1000)
    p.add_argument("--question-chars", type=int, default=200)
    p.add_argument("--answer-chars", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument(
        "--instructions",
        action="store_true",
        help="count the tree's instructions per request under valgrind instead of timing",
    )
    p.add_argument("--no-tree", action="store_true", help="make the texts but feed no tree")
    args = p.parse_args(argv)
    if min(args.requests, args.max_chars, args.tenants, args.groups) < 1:
        p.error("--requests, --max-chars, --tenants and --groups must be >= 1")
    if args.instructions:
        shape = [
            "tools.tree_gc", "--requests", str(args.requests), "--max-chars", str(args.max_chars),
            "--tenants", str(args.tenants), "--groups", str(args.groups),
            "--system-chars", str(args.system_chars), "--question-chars", str(args.question_chars),
            "--answer-chars", str(args.answer_chars), "--seed", str(args.seed),
        ]  # fmt: skip
        try:
            fed, unfed = instructions(shape), instructions([*shape, "--no-tree"])
        except RuntimeError as exc:
            print(f"tree_gc: {exc}", file=sys.stderr)
            return 1
        print(f"tree instructions per request: {(fed - unfed) // args.requests}"
              f" (match + 2 inserts, {args.requests} requests)")  # fmt: skip
        return 0
    result = run(args)
    print(report(result))
    if args.json:
        command = shlex.join(["python", "-m", "tools.tree_gc",
                              *(sys.argv[1:] if argv is None else argv)])  # fmt: skip
        args.json.write_text(json.dumps({"command": command, **result}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
