"""Fit the timing model (a, b, c) to TTFTs measured on a real server (or check the stand-in).

    python -m backends.sim.calibrate --url http://GPU_HOST:30000 --profile h100-llama3-8b

For each point (U uncached tokens after C cached ones) it warms a C-token prefix, then sends
`--repeat` streamed `/generate` requests of that prefix plus U fresh random token ids, with
`max_new_tokens: 1`, one at a time, and keeps the median client-side TTFT. It then fits

    TTFT = b + a * U + c * U * (C + U / 2)

by least squares and prints the fitted values next to the profile's priors. Token ids are
sent as `input_ids`, so the counts are exact whatever the model's tokenizer is.

It can also fit a file written by SGLang's own benchmark (one JSON line per run, with
`--output-details`) over the generated-shared-prefix dataset in order (`--gsp-ordered`):
the first request of each group is uncached (C = 0), the others reuse the system prompt:

    python -m backends.sim.calibrate --from-bench-serving runs.jsonl \
        --gsp-prompts-per-group 16 --gsp-system-prompt-len 2048
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
from collections.abc import Sequence

from backends.sim import probe
from backends.sim.profiles import PROFILES, get_profile

DEFAULT_POINTS = "128:0,512:0,2048:0,8192:0,128:2048,512:2048,2048:2048,128:8192,512:8192"


def parse_points(text: str) -> list[tuple[int, int]]:
    points = []
    for item in text.split(","):
        u, sep, c = item.partition(":")
        if not sep or not u.strip().isdigit() or not c.strip().isdigit() or int(u) < 1:
            raise ValueError(f"bad point {item!r}: expected U:C with U >= 1, C >= 0")
        points.append((int(u), int(c)))
    return points


def fit(samples: Sequence[tuple[int, int, float]]) -> tuple[float, float, float]:
    """Least squares of TTFT = b + a*U + c*U*(C + U/2) over (U, C, ttft): returns (a, b, c)."""
    rows = [(1.0, float(u), u * (c + u / 2)) for u, c, _ in samples]
    ys = [t for _, _, t in samples]
    n = 3
    # Normal equations A^T A x = A^T y, solved by Gaussian elimination with partial pivoting.
    m = [[sum(r[i] * r[j] for r in rows) for j in range(n)] for i in range(n)]
    v = [sum(r[i] * y for r, y in zip(rows, ys, strict=True)) for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-300:
            raise ValueError("points do not determine a, b and c (vary both U and C)")
        m[col], m[pivot] = m[pivot], m[col]
        v[col], v[pivot] = v[pivot], v[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for k in range(col, n):
                m[r][k] -= f * m[col][k]
            v[r] -= f * v[col]
    x = [0.0] * n
    for r in reversed(range(n)):
        x[r] = (v[r] - sum(m[r][k] * x[k] for k in range(r + 1, n))) / m[r][r]
    b, a, c = x
    return a, b, c


def samples_from_bench_serving(
    lines: Sequence[str], *, prompts_per_group: int, system_prompt_len: int
) -> list[tuple[int, int, float]]:
    """(U, C, TTFT) from `sglang.bench_serving --output-details` JSON lines (gsp, ordered)."""
    samples: list[tuple[int, int, float]] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            run = json.loads(line)
            input_lens, ttfts = run["input_lens"], run["ttfts"]
        except (ValueError, KeyError, TypeError):
            msg = f"line {number}: not a bench_serving result with --output-details"
            raise ValueError(msg) from None
        for i, (n, ttft) in enumerate(zip(input_lens, ttfts, strict=False)):
            if not ttft or ttft <= 0:
                continue  # failed request
            if i % prompts_per_group == 0:
                samples.append((int(n), 0, float(ttft)))
            elif n > system_prompt_len:
                samples.append((int(n) - system_prompt_len, system_prompt_len, float(ttft)))
    if len(samples) < 3:
        raise ValueError("fewer than 3 usable requests in the file")
    return samples


async def measure(
    url: str, points: list[tuple[int, int]], repeat: int, seed: int
) -> list[tuple[int, int, float, int]]:
    """[(U, C, median TTFT, cached_tokens reported)]."""
    rng = random.Random(seed)

    def fresh(n: int) -> list[int]:
        return [rng.randrange(1000, 100_000) for _ in range(n)]

    out = []
    for u, c in points:
        prefix = fresh(c)
        if c:
            await probe.post_json(url, "/generate", {"input_ids": prefix + fresh(1),
                                  "sampling_params": {"max_new_tokens": 1}})  # fmt: skip
        ttfts, cached = [], 0
        for _ in range(repeat):
            body = {"input_ids": prefix + fresh(u), "stream": True,
                    "sampling_params": {"max_new_tokens": 1, "ignore_eos": True}}  # fmt: skip
            result = await probe.stream(url, "/generate", body)
            if result.ttft is None:
                raise RuntimeError(f"no token for U={u} C={c} (HTTP {result.status})")
            ttfts.append(result.ttft)
            meta = next(e["meta_info"] for e in result.events if isinstance(e, dict))
            cached = int(meta.get("cached_tokens", 0))
        out.append((u, c, statistics.median(ttfts), cached))
    return out


async def run(url: str, profile_name: str, points: list[tuple[int, int]], repeat: int) -> int:
    profile = get_profile(profile_name)
    results = await measure(url, points, repeat, seed=1)
    a, b, c = fit([(u, cc, t) for u, cc, t, _ in results])
    print(f"== TTFT calibration of {url} ({repeat} runs per point, median, client side) ==")
    print(f"{'U':>7} {'C':>7} {'cached':>7} {'measured ms':>12} {'fit ms':>9} {profile.name:>16}")
    for u, cc, t, cached in results:
        fitted = b + a * u + c * u * (cc + u / 2)
        prior = profile.prefill_time([(u, cc)])
        print(f"{u:>7} {cc:>7} {cached:>7} {t * 1000:>12.2f} {fitted * 1000:>9.2f} "
              f"{prior * 1000:>16.2f}")  # fmt: skip
    print(f"fitted  a = {a * 1e6:.2f} us/token   b = {b * 1000:.2f} ms   c = {c * 1e9:.3f} ns")
    print(f"prior   a = {profile.a * 1e6:.2f} us/token   b = {profile.b * 1000:.2f} ms   "
          f"c = {profile.c * 1e9:.3f} ns   ({profile.name})")  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m backends.sim.calibrate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--url", default="http://127.0.0.1:30000")
    p.add_argument("--profile", default="h100-llama3-8b", choices=sorted(PROFILES))
    p.add_argument("--points", default=DEFAULT_POINTS, help="U:C pairs, comma separated")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--from-bench-serving", metavar="JSONL", default=None,
                   help="fit sglang.bench_serving results instead of measuring")  # fmt: skip
    p.add_argument("--gsp-prompts-per-group", type=int, default=16)
    p.add_argument("--gsp-system-prompt-len", type=int, default=2048)
    args = p.parse_args(argv)
    if args.from_bench_serving:
        try:
            with open(args.from_bench_serving, encoding="utf-8") as f:
                samples = samples_from_bench_serving(
                    f.readlines(),
                    prompts_per_group=args.gsp_prompts_per_group,
                    system_prompt_len=args.gsp_system_prompt_len,
                )
            a, b, c = fit(samples)
        except (OSError, ValueError) as exc:
            p.error(str(exc))
        print(f"{len(samples)} requests: a = {a * 1e6:.2f} us/token   b = {b * 1000:.2f} ms   "
              f"c = {c * 1e9:.3f} ns")  # fmt: skip
        return 0
    try:
        points = parse_points(args.points)
    except ValueError as exc:
        p.error(str(exc))
    if args.repeat < 1:
        p.error("--repeat must be >= 1")
    return asyncio.run(run(args.url.rstrip("/"), args.profile, points, args.repeat))


if __name__ == "__main__":
    sys.exit(main())
