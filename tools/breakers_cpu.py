"""CPU per request of the circuit breakers: `allowed`, `started` and `ended` as `edge.attempt`
calls them, for a few candidates across two hardware groups.

    python -m tools.breakers_cpu [--candidates 3] [--number 200000]

Prints the best of five timed runs per call, in microseconds, with every breaker closed and
with one domain's breaker open (the candidate list is then filtered).
"""

from __future__ import annotations

import argparse
import timeit
from collections.abc import Callable

from backends.registry import Backend, parse_labels
from edge.routing.breakers import BreakerConfig, Breakers


def _backends(n: int) -> list[Backend]:
    out = []
    for i in range(n):
        url, labels = parse_labels(f"http://10.0.0.{i + 1}:30000#hardware={'ab'[i % 2]}")
        out.append(Backend(name=f"b{i}", url=url, labels=labels))
    return out


def _best(call: Callable[[], object], number: int) -> float:
    return min(timeit.repeat(call, number=number, repeat=5)) / number * 1e6


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.breakers_cpu", description=__doc__)
    parser.add_argument("--candidates", type=int, default=3)
    parser.add_argument("--number", type=int, default=200_000)
    args = parser.parse_args(argv)
    if args.candidates < 2 or args.number < 1:
        parser.error("--candidates must be >= 2 and --number >= 1")
    backends = _backends(args.candidates)
    closed = Breakers(BreakerConfig().validate(), backends)
    closed.update_kv()  # the background scan: every domain known
    breaker = closed.started(backends[0], "gold")
    assert breaker is not None
    rows = [
        ("allowed, every breaker closed", _best(lambda: closed.allowed(backends, "gold"),
                                                 args.number)),
        ("started", _best(lambda: closed.started(backends[0], "gold"), args.number)),
        ("ended (a success with its TTFT)",
         _best(lambda: closed.ended(breaker, None, 0.01, 100), args.number)),
    ]  # fmt: skip
    one_open = Breakers(BreakerConfig().validate(), backends)
    one_open.update_kv()
    failing = one_open.started(backends[1], "gold")
    assert failing is not None
    for _ in range(one_open.config.min_requests):
        one_open.ended(failing, "5xx", None)
    rows.append(
        ("allowed, one domain open", _best(lambda: one_open.allowed(backends, "gold"),
                                            args.number))
    )  # fmt: skip
    print(f"circuit breakers, {args.candidates} candidates, best of 5 x {args.number} calls")
    for name, micros in rows:
        print(f"  {name:<34} {micros:6.2f} us")


if __name__ == "__main__":
    main()
