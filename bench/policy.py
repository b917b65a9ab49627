"""What the policy gateway costs: TTFT with 20 rules and one WebAssembly module on vs off, and
inter-token latency with a stream rule that never matches.

    python -m bench.policy --out bench-out/policy [--rounds 8 --per-round 40 --concurrency 1 32]

Two phases, each with its own stand-in (`python -m backends.sim`) and edges in front of it, all
measured in interleaved rounds by `bench.edge_latency`'s client (one thread, plain keep-alive
HTTP/1.1, so that the client costs less than what is measured):

1. TTFT: the `instant` stand-in, `max_tokens` 1; targets `direct` (the stand-in), `off` (an edge
   with no policy) and `on` (an edge with `RULES`: 20 rules, and `deny_keyword.wasm`). The
   figure is `on` - `off` at TTFT p50 (and p99), per concurrency level.
2. ITL: the `h100-llama3-8b` stand-in (a real decode rhythm), `--itl-tokens` tokens; targets
   `off` and `stream` (an edge with one stream rule that never matches the stand-in's text).
   The figure is `stream` - `off` at inter-token p99.
3. Audit: the `instant` stand-in, `max_tokens` 1, `--audit-streams` closed-loop connections
   (as fast as one worker answers); targets `off` and `audit` (an edge writing the audit log).
   The figures: requests per second of each, and the audit edge's lines written, dropped, and
   found in its file by `quicedge audit verify`.

Edges run on the last CPU, the stand-in and the client on the others (as `bench.edge_latency
--spawn` does). Writes OUT/policy.md and OUT/policy.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import time
import tomllib
import urllib.request
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from bench.children import REPO, free_port, split_cpus, start, start_stand_in, stop, wait_listening
from bench.edge_latency import _target, measure, summarize

EXAMPLE = REPO / "edge" / "policy" / "examples" / "deny_keyword.wasm"

RULES = [
    ("api-keys", "deny", [r"\b(?:sk|pk)-[A-Za-z0-9]{20,}", r"api[_ -]?key\s*[:=]"]),
    ("aws-keys", "deny", [r"\bAKIA[0-9A-Z]{16}\b"]),
    ("private-keys", "deny", [r"BEGIN (?:RSA |EC )?PRIVATE KEY"]),
    ("passwords", "deny", [r"password\s*[:=]\s*\S+"]),
    ("jailbreak-1", "deny", [r"ignore (?:all )?previous instructions"]),
    ("jailbreak-2", "deny", [r"\bDAN mode\b", r"developer mode enabled"]),
    ("weapons", "deny", [r"\bnerve agent synthesis\b", r"build a (?:pipe )?bomb"]),
    ("malware", "deny", [r"\bransomware (?:builder|source)\b", r"\bkeylogger source\b"]),
    ("self-harm", "deny", [r"\bhow to (?:kill|harm) myself\b"]),
    ("csam", "deny", [r"\bminor\b.{0,20}\bexplicit\b"]),
    ("exfil", "deny", [r"\bdump (?:the )?(?:database|credentials)\b"]),
    ("internal-hosts", "deny", [r"\b[a-z0-9-]+\.corp\.internal\b"]),
    ("research-ok", "allow", [r"\bfor a security course\b"]),
    ("email", "redact", [r"[\w.+-]+@[\w-]+\.[\w.]+"]),
    ("phone", "redact", [r"\+?\d{1,3}[ -]?\(?\d{3}\)?[ -]?\d{3}[ -]?\d{4}\b"]),
    ("ssn", "redact", [r"\b\d{3}-\d{2}-\d{4}\b"]),
    ("card", "redact", [r"\b(?:\d[ -]?){13,16}\b"]),
    ("iban", "redact", [r"\b[A-Z]{2}\d{2}(?: ?[A-Z0-9]{4}){3,7}\b"]),
    ("ipv4", "redact", [r"\b(?:\d{1,3}\.){3}\d{1,3}\b"]),
    ("jwt", "redact", [r"\beyJ[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+"]),
]
"""Twenty rules of the kinds an operator writes: secrets, jailbreaks, harms, PII."""


def _toml_list(items: list[str]) -> str:
    return "[" + ", ".join(json.dumps(i) for i in items) + "]"


def rules_toml() -> str:
    out = []
    for rule_id, action, patterns in RULES:
        out.append(f'[[policy.rules]]\nid = "{rule_id}"\naction = "{action}"\n'
                   f"patterns = {_toml_list(patterns)}\n")  # fmt: skip
    out.append(f'[[policy.wasm]]\nid = "deny-keyword"\npath = "{EXAMPLE}"\n')
    return "\n".join(out)


def audit_toml(out: Path) -> str:
    return f'[audit]\npath = "{out / "audit-{pid}.jsonl"}"\n'


STREAM_TOML = """[[policy.stream_rules]]
id = "key-leak"
patterns = ["BEGIN PRIVATE KEY", "AKIA[0-9A-Z]{16}"]
"""


def phase(
    out: Path,
    name: str,
    *,
    profile: str,
    edges: dict[str, str | None],
    direct: bool,
    args: argparse.Namespace,
    max_tokens: int,
    concurrency: list[int],
) -> list[dict[str, Any]]:
    """Start a stand-in and one edge per config (None: no config file), measure, stop."""
    edge_cpus, others = split_cpus(True)
    runs = []
    with ExitStack() as stack:
        sim, sim_url = start_stand_in(
            stack, log=out / f"{name}-sim.log", cpus=others, profile=profile
        )
        urls: dict[str, str] = {"direct": sim_url} if direct else {}
        admins: dict[str, str] = {}
        pids = {"sim": sim.proc.pid}
        for edge_name, toml in edges.items():
            http, admin = free_port(), free_port()
            cmd = [
                sys.executable, "-m", "edge.cli", "serve", "--backend", sim_url,
                "--http", f"127.0.0.1:{http}",
                "--h3", f"127.0.0.1:{free_port(socket.SOCK_DGRAM)}",
                "--tcp", f"127.0.0.1:{free_port()}", "--admin", f"127.0.0.1:{admin}",
            ]  # fmt: skip
            if toml is not None:
                path = out / f"{name}-{edge_name}.toml"
                path.write_text(toml)
                cmd += ["--config", str(path)]
            child = start(edge_name, cmd, log=out / f"{name}-{edge_name}.log", cpus=edge_cpus,
                           cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)))  # fmt: skip
            stack.callback(stop, child)
            wait_listening(child, http)
            urls[edge_name] = f"http://127.0.0.1:{http}"
            admins[edge_name] = f"http://127.0.0.1:{admin}/metrics"
            pids[edge_name] = child.proc.pid
        if others:
            os.sched_setaffinity(0, others)
        for n in concurrency:
            targets = [_target(f"{k}={v}") for k, v in urls.items()]
            measure(
                targets, concurrency=n, max_tokens=max_tokens, prompt_words=args.prompt_words,
                rounds=args.rounds, per_round=args.per_round, warmup=args.warmup,
                pause_s=args.pause_ms / 1e3, pids=pids,
            )  # fmt: skip
            counts = {k: policy_counts(v) for k, v in admins.items()}
            runs.append({"concurrency": n, "targets": summarize(targets), "policy_counts": counts})
    return runs


_COUNTED = (
    "quicedge_policy_decisions_total",
    "quicedge_policy_module_failures",
    "quicedge_audit_written_total",
    "quicedge_audit_dropped_total",
    "quicedge_requests_total",
    'quicedge_stage_seconds_sum{stage="admit"}',
    'quicedge_stage_seconds_count{stage="admit"}',
)


def policy_counts(metrics_url: str) -> dict[str, float]:
    """The edge's policy decision counters (proof that the policy ran on every request) and its
    admit stage's time (where the request policy runs), summed since the edge started."""
    with urllib.request.urlopen(metrics_url, timeout=5) as response:
        text = response.read().decode()
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(_COUNTED)
    }


def admit_us(counts: dict[str, float]) -> float | None:
    """Mean time in the admit stage (validate, model check, request policy, view), us."""
    total = counts.get('quicedge_stage_seconds_sum{stage="admit"}')
    n = counts.get('quicedge_stage_seconds_count{stage="admit"}')
    return total / n * 1e6 if total is not None and n else None


def in_process(samples: int = 2000) -> dict[str, float]:
    """CPU per call of the request stage (20 rules + the module) and of the stream guard per
    chunk, in this process: the gateway's own cost, free of the machine's scheduling noise."""
    from edge.policy.config import PolicyConfig
    from edge.policy.gateway import PolicyGateway

    config = PolicyConfig.from_mapping(tomllib.loads(rules_toml() + "\n" + STREAM_TOML)["policy"])
    gateway = PolicyGateway(config)
    assert gateway.stream is not None
    body = {"model": "m", "messages": [{"role": "user", "content": "hello " * 64}]}
    check = gateway.check
    start = time.process_time()
    for _ in range(samples):
        check("/v1/chat/completions", body, tenant="t", tier="t", stream=True)
    request_us = (time.process_time() - start) / samples * 1e6
    event = (b'data: {"id":"x","object":"chat.completion.chunk","choices":[{"index":0,'
             b'"delta":{"content":" bouzai"},"finish_reason":null}]}\n\n')  # fmt: skip
    guard = gateway.stream.guard("/v1/chat/completions")
    start = time.process_time()
    for _ in range(samples):
        guard.feed(event)
    chunk_us = (time.process_time() - start) / samples * 1e6
    # The same calls with the caches emptied before each (16 MiB copied), as they find them in
    # an edge whose other work ran in between: timed per call, the copy outside the timing; the
    # median, since a call that a scheduler tick lands in is 10 times the others.
    flush, junk = bytes(16 * 1024 * 1024), bytearray(16 * 1024 * 1024)
    view = json.dumps({"prompt": "hello " * 64}).encode()

    def cold(call: Callable[[], object]) -> float:
        times = []
        for _ in range(max(1, samples // 4)):
            junk[:] = flush
            t = time.perf_counter()
            call()
            times.append(time.perf_counter() - t)
        return statistics.median(times) * 1e6

    cold_us = cold(lambda: check("/v1/chat/completions", body, tenant="t", tier="t", stream=True))
    module_cold_us = cold(lambda: gateway.modules[0].check(view))
    gateway.rules = None  # the module alone
    start = time.process_time()
    for _ in range(samples):
        check("/v1/chat/completions", body, tenant="t", tier="t", stream=True)
    module_us = (time.process_time() - start) / samples * 1e6
    return {"request_stage_us": request_us, "request_stage_cold_us": cold_us,
            "module_only_us": module_us, "module_call_cold_us": module_cold_us,
            "stream_guard_per_chunk_us": chunk_us}  # fmt: skip


def audit_phase(out: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Requests per second with and without the audit log, and what the log holds after."""
    for old in out.glob("audit-*.jsonl*"):
        old.unlink()
    args.pause_ms = 0.0  # back to back: the worker's full rate
    args.per_round = args.audit_per_round
    runs = phase(out, "audit", profile="instant", direct=False,
                 edges={"off": None, "audit": audit_toml(out)}, args=args, max_tokens=1,
                 concurrency=args.audit_streams)  # fmt: skip
    files = sorted(out.glob("audit-*.jsonl"))
    lines = sum(sum(1 for _ in f.open("rb")) for f in files)
    verified = bool(files) and all(
        subprocess.run([sys.executable, "-m", "edge.cli", "audit", "verify", str(f)], cwd=REPO,
                       capture_output=True).returncode == 0
        for f in files
    )  # fmt: skip
    return [{**run, "audit_lines": lines, "audit_verified": verified} for run in runs]


def _row(run: dict[str, Any], name: str) -> dict[str, Any]:
    return next(t for t in run["targets"] if t["name"] == name)


def _d(a: dict[str, Any], b: dict[str, Any], series: str, q: str) -> float | None:
    if a[series] is None or b[series] is None:
        return None
    return float(a[series][q] - b[series][q])


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:+.3f}"


def markdown(result: dict[str, Any]) -> str:
    lines = [f"`{result['command']}`", "", f"{result['date']}; {result['machine']}", ""]
    cpu = result["in_process"]
    lines += [f"In-process CPU: request stage (20 rules + module) {cpu['request_stage_us']:.1f} us"
              f" per request ({cpu['request_stage_cold_us']:.1f} us with the caches emptied"
              f" before each call, median), of which the module {cpu['module_only_us']:.1f} us"
              f" ({cpu['module_call_cold_us']:.1f} us its call alone, caches emptied); stream"
              f" guard {cpu['stream_guard_per_chunk_us']:.1f} us per chunk.", ""]  # fmt: skip
    lines += ["TTFT (ms), `instant` stand-in, `max_tokens` 1; admit stage: the edge's own mean "
              "time in it, us (cumulative over the levels run so far):", "",
              "| streams | off p50 | on p50 | on - off p50 | on - off p99 | off - direct p50 "
              "| admit off | admit on |",
              "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for run in result["ttft"]:
        off, on, direct = _row(run, "off"), _row(run, "on"), _row(run, "direct")
        counts = run["policy_counts"]
        a_off, a_on = admit_us(counts["off"]), admit_us(counts["on"])
        lines.append(
            f"| {run['concurrency']} | {off['ttft_ms']['p50']:.3f} | {on['ttft_ms']['p50']:.3f} "
            f"| {_f(_d(on, off, 'ttft_ms', 'p50'))} | {_f(_d(on, off, 'ttft_ms', 'p99'))} "
            f"| {_f(_d(off, direct, 'ttft_ms', 'p50'))} "
            f"| {'-' if a_off is None else f'{a_off:.1f}'} "
            f"| {'-' if a_on is None else f'{a_on:.1f}'} |"
        )
    lines += ["", f"Inter-token latency (ms), `h100-llama3-8b` stand-in, "
              f"{result['itl_tokens']} tokens:", "",
              "| streams | off p50 | off p99 | stream p50 | stream p99 | stream - off p99 |",
              "| ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for run in result["itl"]:
        off, st = _row(run, "off"), _row(run, "stream")
        lines.append(
            f"| {run['concurrency']} | {off['itl_ms']['p50']:.3f} | {off['itl_ms']['p99']:.3f} "
            f"| {st['itl_ms']['p50']:.3f} | {st['itl_ms']['p99']:.3f} "
            f"| {_f(_d(st, off, 'itl_ms', 'p99'))} |"
        )
    for run in result.get("audit") or []:
        off, audit = _row(run, "off"), _row(run, "audit")
        counts = run["policy_counts"]["audit"]
        # Everything the edge answered, the warm-up included, as the log records it.
        served = sum(v for k, v in counts.items() if k.startswith("quicedge_requests_total"))
        lines += ["", f"Audit log, {run['concurrency']} closed-loop streams, `instant` stand-in:",
                  "", "| edge | req/s | requests answered | lines written | dropped "
                  "| lines in the file | `quicedge audit verify` |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
                  f"| off | {off['req_per_s']:.0f} | {off['requests']} | | | | |",
                  f"| audit | {audit['req_per_s']:.0f} | {served:.0f} "
                  f"| {counts.get('quicedge_audit_written_total', 0):.0f} "
                  f"| {counts.get('quicedge_audit_dropped_total', 0):.0f} "
                  f"| {run['audit_lines']} "
                  f"| {'ok' if run['audit_verified'] else 'FAILED'} |"]  # fmt: skip
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.policy", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--out", default="bench-out/policy")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--per-round", type=int, default=40)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--pause-ms", type=float, default=2.0)
    p.add_argument("--prompt-words", type=int, default=64)
    p.add_argument("--itl-tokens", type=int, default=32)
    p.add_argument("--itl-per-round", type=int, default=16,
                   help="requests per target and round, ITL phase (each is long)")  # fmt: skip
    p.add_argument("--skip-itl", action="store_true", help="no ITL phase")
    p.add_argument("--audit-per-round", type=int, default=3200,
                   help="requests per target and round, audit phase")  # fmt: skip
    p.add_argument("--audit-streams", type=int, nargs="*", default=[32],
                   help="audit phase: connections per level (none: skip it)")  # fmt: skip
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ttft = phase(out, "ttft", profile="instant", direct=True,
                 edges={"off": None, "on": rules_toml()}, args=args, max_tokens=1,
                 concurrency=args.concurrency)  # fmt: skip
    itl: list[dict[str, Any]] = []
    if not args.skip_itl:
        args.per_round = args.itl_per_round
        itl = phase(out, "itl", profile="h100-llama3-8b", direct=False,
                    edges={"off": None, "stream": STREAM_TOML}, args=args,
                    max_tokens=args.itl_tokens, concurrency=args.concurrency)  # fmt: skip
    audit = audit_phase(out, args) if args.audit_streams else None
    result = {
        "command": shlex.join(["python", "-m", "bench.policy", *argv]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "machine": f"{os.cpu_count()} CPUs, Python {platform.python_version()}, load average "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} at the end",
        "itl_tokens": args.itl_tokens,
        "in_process": in_process(),
        "ttft": ttft,
        "itl": itl,
        "audit": audit,
    }
    (out / "policy.json").write_text(json.dumps(result, indent=2) + "\n")
    text = markdown(result)
    (out / "policy.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
