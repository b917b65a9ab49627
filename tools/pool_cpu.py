"""CPU time the upstream pool spends per streamed request, with nothing else in the process.

    python -m tools.pool_cpu http://127.0.0.1:31001 --max-tokens 64 --requests 100 --repeats 5 \\
        [--loop uvloop] [--chunk-timeout 30]

Streams `--requests` chat completions one after another through one `UpstreamPool` and reports
the process CPU time (user + system) per request: the minimum and median over `--repeats`
repetitions, and how many reads each body took. Fewer reads per body means chunks arrived
together, because the backend was ahead of the reader. An answer other than 200 fails the run
(exit 1, the statuses on stderr) rather than be timed as a request.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from backends.pool import UpstreamPool
from transport.loop import LOOPS
from transport.loop import run as run_on_loop


async def measure(
    url: str, *, max_tokens: int, requests: int, repeats: int, chunk_timeout: float | None
) -> tuple[list[float], float, dict[int, int]]:
    """CPU seconds per request of each repeat, reads per body, and the count of each status
    other than 200 (an error answer costs less than a stream: it would pass for the pool's)."""
    body = json.dumps(
        {
            "model": "default",
            "stream": True,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": "hello " * 64}],
        }
    ).encode()
    headers = [(b"content-type", b"application/json")]
    pool = UpstreamPool()
    per_request: list[float] = []
    reads = 0
    refused: dict[int, int] = {}
    try:
        for _ in range(repeats):
            start = time.process_time()
            for _ in range(requests):
                response = await pool.request(
                    url, "POST", "/v1/chat/completions", headers=headers, body=body,
                    first_byte_timeout=chunk_timeout, chunk_timeout=chunk_timeout,
                )  # fmt: skip
                if response.status != 200:
                    refused[response.status] = refused.get(response.status, 0) + 1
                async for _chunk in response:
                    reads += 1
            per_request.append((time.process_time() - start) / requests)
    finally:
        await pool.aclose()
    return per_request, reads / (requests * repeats), refused


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.pool_cpu", description=__doc__)
    p.add_argument("url", help="backend base URL, e.g. http://127.0.0.1:31001")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--requests", type=int, default=100)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--chunk-timeout", type=float, default=None, help="s; default none")
    p.add_argument("--loop", choices=LOOPS, default="auto")
    args = p.parse_args(argv)
    try:
        per_request, reads, refused = run_on_loop(
            measure(
                args.url.rstrip("/"),
                max_tokens=args.max_tokens,
                requests=args.requests,
                repeats=args.repeats,
                chunk_timeout=args.chunk_timeout,
            ),
            args.loop,
        )
    except (OSError, ValueError) as exc:
        print(f"pool_cpu: {exc}", file=sys.stderr)
        return 1
    if refused:
        total = args.requests * args.repeats
        for status, count in sorted(refused.items()):
            print(f"pool_cpu: {count} of {total} requests answered {status}", file=sys.stderr)
        return 1
    print(
        f"pool CPU per request: min {min(per_request) * 1e3:.2f} ms,"
        f" median {statistics.median(per_request) * 1e3:.2f} ms; reads per body {reads:.1f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
