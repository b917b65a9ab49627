"""Check a running server (the stand-in or a real SGLang) against a timing profile.

    quicedge sim --profile h100-llama3-8b --enable-metrics --enable-cache-report \\
        --max-running-requests 16 --port 30000 &
    python -m backends.sim.selfcheck --url http://127.0.0.1:30000 --profile h100-llama3-8b

1. A streamed chat completion with a 2,000-token system prompt: client TTFT vs the profile's
   prediction (within +-25 %).
2. The same request again: cached_tokens = prompt_tokens - 1 and a TTFT at least 5x lower.
3. 40 concurrent requests with --max-running-requests 16: /v1/loads and /metrics show 16
   running and 24 queued (then they are aborted).
Prints a report; exit status 0 when every check passes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from typing import Any

from backends.sim import probe
from backends.sim.profiles import PROFILES, get_profile
from backends.sim.textgen import WORDS


def system_prompt(words: int, salt: int = 0) -> str:
    """`words` words; a different `salt` differs from the first word on (a fresh prefix)."""
    return "".join(WORDS[(i * 7 + salt) % len(WORDS)] for i in range(words))


async def _usage_of(result: probe.StreamResult) -> dict[str, Any]:
    for event in reversed(result.events):
        if isinstance(event, dict) and event.get("usage"):
            return dict(event["usage"])
    raise RuntimeError("no usage chunk in the stream")


def _metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


async def _server_ttft(url: str) -> tuple[float, float]:
    """(sum, count) of the server's TTFT histogram; (0, 0) without /metrics."""
    status, raw = await probe.get(url, "/metrics")
    if status != 200:
        return 0.0, 0.0
    text = raw.decode()
    total = _metric(text, "sglang:time_to_first_token_seconds_sum") or 0.0
    count = _metric(text, "sglang:time_to_first_token_seconds_count") or 0.0
    return total, count


async def check_ttft(url: str, profile_name: str, lines: list[str]) -> bool:
    profile = get_profile(profile_name)
    body = {
        "messages": [
            {"role": "system", "content": system_prompt(2000, salt=random.randrange(1, 1000))},
            {"role": "user", "content": "Summarise the above."},
        ],
        "max_tokens": 8,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    before = await _server_ttft(url)
    cold = await probe.stream(url, "/v1/chat/completions", body)
    middle = await _server_ttft(url)
    warm = await probe.stream(url, "/v1/chat/completions", body)
    after = await _server_ttft(url)
    server_cold = middle[0] - before[0] if middle[1] - before[1] == 1 else None
    server_warm = after[0] - middle[0] if after[1] - middle[1] == 1 else None
    if cold.ttft is None or warm.ttft is None:
        raise RuntimeError(f"no generated text (HTTP {cold.status}/{warm.status})")
    usage_cold, usage_warm = await _usage_of(cold), await _usage_of(warm)
    prompt_tokens = usage_cold["prompt_tokens"]
    cached_cold = (usage_cold.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    cached = (usage_warm.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    predicted = profile.predict_ttft(prompt_tokens, cached_cold)
    predicted_warm = profile.predict_ttft(prompt_tokens, prompt_tokens - 1)
    error = cold.ttft / predicted - 1
    ratio = cold.ttft / warm.ttft
    ok1 = abs(error) <= 0.25
    ok2 = cached == prompt_tokens - 1 and ratio >= 5
    server = (
        f"server-side TTFT (sglang:time_to_first_token_seconds) cold {server_cold * 1000:.1f} ms, "
        f"warm {server_warm * 1000:.1f} ms, ratio {server_cold / server_warm:.1f}x"
        if server_cold and server_warm
        else "server-side TTFT: no /metrics (start the server with --enable-metrics)"
    )
    lines += [
        f"prompt tokens                      {prompt_tokens} ({cached_cold} cached: template)",
        f"TTFT cold (client)                 {cold.ttft * 1000:.1f} ms",
        f"TTFT predicted by {profile.name:<16} {predicted * 1000:.1f} ms",
        f"error vs prediction                {error * 100:+.1f} %   [{'PASS' if ok1 else 'FAIL'}]",
        f"TTFT warm (client)                 {warm.ttft * 1000:.1f} ms "
        f"(predicted {predicted_warm * 1000:.1f} ms)",
        f"cached_tokens on the repeat        {cached} (prompt_tokens - 1 = {prompt_tokens - 1})",
        f"TTFT ratio cold / warm             {ratio:.1f}x   [{'PASS' if ok2 else 'FAIL'}]",
        server,
    ]
    return ok1 and ok2


async def _load(url: str) -> dict[str, int]:
    """Running and waiting counts from /v1/loads, or the legacy /get_load list."""
    status, raw = await probe.get(url, "/v1/loads")
    if status == 200:
        entry = json.loads(raw)["loads"][0]
        return {k: int(entry[k]) for k in ("num_running_reqs", "num_waiting_reqs")}
    entry = (await probe.get_json(url, "/get_load"))[0]
    waiting = int(entry["num_waiting_reqs"])
    return {"num_running_reqs": int(entry["num_reqs"]) - waiting, "num_waiting_reqs": waiting}


async def check_queue(url: str, lines: list[str], *, total: int = 40, running: int = 16) -> bool:
    body = {"text": "count to a million", "sampling_params": {"max_new_tokens": 100_000,
            "ignore_eos": True}}  # fmt: skip
    tasks = [
        asyncio.create_task(probe.post_json(url, "/generate", {**body, "rid": f"selfcheck-{i}"}))
        for i in range(total)
    ]
    try:
        deadline = time.monotonic() + 30
        while True:
            load = await _load(url)
            if load["num_running_reqs"] + load["num_waiting_reqs"] >= total:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"requests never all arrived: {load}")
            await asyncio.sleep(0.05)
        status, raw = await probe.get(url, "/metrics")
        text = raw.decode() if status == 200 else ""
        m_running = _metric(text, "sglang:num_running_reqs")
        m_queued = _metric(text, "sglang:num_queue_reqs")
    finally:
        await probe.post_json(url, "/abort_request", {"abort_all": True})
        await asyncio.gather(*tasks, return_exceptions=True)
    queued = total - running
    ok = (load["num_running_reqs"], load["num_waiting_reqs"]) == (running, queued) and (
        m_running,
        m_queued,
    ) == (running, queued)
    lines += [
        f"{total} concurrent requests, cap {running}: /v1/loads running={load['num_running_reqs']} "
        f"queued={load['num_waiting_reqs']}; /metrics running={m_running} queued={m_queued}"
        f"   [{'PASS' if ok else 'FAIL'}]",
    ]
    return ok


async def run(url: str, profile: str) -> int:
    lines = [f"== selfcheck of {url} against profile {profile} =="]
    ok = await check_ttft(url, profile, lines)
    ok = await check_queue(url, lines) and ok
    print("\n".join(lines))
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m backends.sim.selfcheck", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--url", default="http://127.0.0.1:30000")
    p.add_argument("--profile", default="h100-llama3-8b", choices=sorted(PROFILES))
    args = p.parse_args(argv)
    return asyncio.run(run(args.url.rstrip("/"), args.profile))


if __name__ == "__main__":
    sys.exit(main())
