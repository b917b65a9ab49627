"""What the edge adds to TTFT and inter-token latency, measured with the cheapest client there is.

    python -m bench.edge_latency direct=http://127.0.0.1:31001 edge=http://127.0.0.1:31080 \\
        --max-tokens 64 --concurrency 1 32 --rounds 10 --per-round 64 \\
        [--cpu-pid sim=PID --cpu-pid edge=PID] [--json report.json]
    python -m bench.edge_latency --spawn --out DIR --concurrency 1 32 --max-tokens 64

An asyncio client costs more per request than the edge's own work on a small machine, so this
one drives plain keep-alive HTTP/1.1 connections from one thread, with non-blocking sockets and
a selector (no event loop): `--concurrency N` connections per target, each a closed loop that
sends its next request as soon as the previous answer ended (after `--pause-ms`). A single
connection reads blocking instead, which saves a system call per read. Targets are measured in
interleaved rounds (A, B, A, B, ...) so that drift in the machine's load (other processes, CPU
frequency) lands on every target alike. A round is `--per-round` requests to one target, spread
evenly over its N connections (rounded up to a multiple of N), so that every concurrency level
gets as many samples. Each level is its own run, on its own connections.

Arrivals are stamped when the selector reports the socket readable (one connection: when the
read returns). Per request: the first response byte, the first content token, and each content
token's arrival (an SSE event whose delta carries text). Inter-token latency (ITL) is the gap
between consecutive content tokens of one answer; tokens that arrive in one read arrived
together, so the extra ones count as gaps of 0. Per target: first byte, TTFT (p50/p90/p99),
ITL (p50/p99), requests/s over its rounds, and for `--cpu-pid` processes the CPU time (user +
system, from /proc) each spent per request while that target was measured. Targets after the
first are also reported as "added" over the first: differences of the percentiles (TTFT p50
and p99, ITL p99, first byte p50). `--json PATH` writes all of it.

Every request carries its own `rid`. Against a stand-in that records timings
(`backends.sim --record-timings N`; give its URL with `--sim-timings`), each request is also split
into a request leg (client send → the stand-in's read) and a response leg (the stand-in's
first-token write → the client's read), and each target's legs are reported with what it adds
over the first (`bench.legs`): unlike TTFT, they leave out the client's own wake-ups, and unlike
the edge's own histograms, they include the time a request or a token waited in the kernel
before the edge read it.

`--spawn` runs the whole measurement: it starts a stand-in (`python -m backends.sim`, `instant`
unless `--sim-profile` and `--sim-time-scale` say otherwise) and one edge in front of it
(`python -m edge.cli serve`, free ports), measures `direct` against
`edge` at each `--concurrency`, writes OUT/edge_latency.md and OUT/edge_latency.json, and stops
both; the stand-in records timings, so the legs are reported too. With two CPUs or more, the
edge is pinned to the last one and the stand-in and this client
to the others (`--no-pin`: not pinned). `--edge-python` and `--edge-cwd` run another tree's edge
(another commit's checkout) for before/after comparisons; `--edge-arg` adds arguments to
`serve`. The edge's CPU is its main process (with `--workers`, not the workers').
`--reference caddy` and `--reference nginx` also measure a compiled proxy in front of the same
stand-in, on the edge's CPU, in the same rounds (`bench.reference_proxies`): what this machine
allows any proxy, to read the edge's figures against.

The client runs at real-time priority (SCHED_FIFO 10, not inherited by children; `--no-rt`:
normal) where the system allows it. It is the instrument: when it shares a core with a busy
stand-in, the kernel may let the stand-in run out its time slice before the woken client reads,
and that wait would be charged to whatever woke it. Measured here at one connection and 64
tokens, that wait put +3.3 ms on the edge's added TTFT p50; at real-time priority, +0.9 ms.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import os
import platform
import re
import selectors
import shlex
import signal
import socket
import sys
import time
from array import array
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from bench import edge_histograms, legs, reference_proxies
from bench.children import (
    REPO,
    free_port,
    split_cpus,
    start,
    start_stand_in,
    stop,
    wait_listening,
)
from bench.summary import rank_index

_CONTENT = re.compile(rb'"(?:content|text)"\s*:\s*"[^"]')


@dataclass
class Target:
    name: str
    host: str
    port: int
    first_byte_ms: list[float] = field(default_factory=list)
    ttft_ms: list[float] = field(default_factory=list)
    itl_ms: array[float] = field(default_factory=lambda: array("d"))
    cpu_s: dict[str, float] = field(default_factory=dict)
    requests: int = 0
    wall_s: float = 0.0
    sent: list[tuple[str, float, float]] = field(default_factory=list)
    """(rid, sent at, first token at) per request, for `bench.legs`."""

    def fresh(self) -> Target:
        """The same address with no measurements (one per concurrency level)."""
        return Target(self.name, self.host, self.port)

    def record(self, r: Response) -> None:
        tokens = r.tokens
        self.first_byte_ms.append((r.first_byte - r.t0) * 1e3)
        self.ttft_ms.append((tokens[0] - r.t0) * 1e3)
        self.itl_ms.extend([(b - a) * 1e3 for a, b in itertools.pairwise(tokens)])
        self.sent.append((r.rid, r.t0, tokens[0]))
        self.requests += 1


def _target(spec: str) -> Target:
    name, sep, url = spec.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected NAME=http://host:port, got {spec!r}")
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise argparse.ArgumentTypeError(f"expected a plain http:// URL, got {url!r}")
    return Target(name, parts.hostname, parts.port or 80)


def _pid(spec: str) -> tuple[str, int]:
    name, sep, pid = spec.partition("=")
    if not sep or not pid.isdigit():
        raise argparse.ArgumentTypeError(f"expected NAME=PID, got {spec!r}")
    return name, int(pid)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


RID_PREFIX = "el-"
RID_DIGITS = 12
_rids = itertools.count(1)


class Request:
    """The request's bytes, with a fresh `rid` (fixed width) spliced in for every send: the
    stand-in records its timings under it (`bench.legs`), and the edge passes it on."""

    __slots__ = ("_at", "_wire")

    def __init__(self, wire: bytes) -> None:
        self._wire = wire
        self._at = wire.index(RID_PREFIX.encode() + b"0" * RID_DIGITS) + len(RID_PREFIX)

    def next(self) -> tuple[str, bytes]:
        digits = b"%0*d" % (RID_DIGITS, next(_rids))
        at, wire = self._at, self._wire
        return RID_PREFIX + digits.decode(), wire[:at] + digits + wire[at + RID_DIGITS :]


def request_bytes(host: str, max_tokens: int, prompt_words: int) -> bytes:
    body = json.dumps(
        {
            "rid": RID_PREFIX + "0" * RID_DIGITS,
            "model": "default",
            "stream": True,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": "hello " * prompt_words}],
        }
    ).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


class Response:
    """One HTTP/1.1 response, fed as it arrives: where it ends (chunked framing or
    Content-Length, so a keep-alive connection knows when the next answer starts), and when its
    first byte and each content token arrived."""

    __slots__ = ("rid", "t0", "first_byte", "tokens", "done", "_wire", "_head", "_chunked",
                 "_left", "_sse")  # fmt: skip

    def __init__(self, t0: float, rid: str = "") -> None:
        self.rid = rid
        self.t0 = t0
        self.first_byte = 0.0  # 0: nothing arrived yet
        self.tokens: list[float] = []
        self.done = False
        self._wire = b""  # bytes not yet decoded (a partial head or chunk-size line)
        self._head = False
        self._chunked = False
        self._left = 0  # body bytes still due: of the current chunk (+ CRLF), or of Content-Length
        self._sse = b""  # body text of an SSE event not yet complete

    def feed(self, data: bytes, now: float) -> bool:
        """Take bytes that arrived at `now`; True once the response is complete."""
        if not self.first_byte:
            self.first_byte = now
        wire = self._wire + data if self._wire else data
        pos = 0
        if not self._head:
            end = wire.find(b"\r\n\r\n")
            if end < 0:
                self._wire = wire
                return False
            self._parse_head(wire[:end])
            pos = end + 4
        body, pos = self._body(wire, pos) if not self.done else (b"", pos)
        self._wire = wire[pos:]
        if body or self.done:
            self._events(body, now)
        if self.done and self._wire:
            raise ValueError("the server sent bytes after the end of the response")
        return self.done

    def _parse_head(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        status = lines[0].split(b" ", 2)
        if len(status) < 2 or status[1] != b"200":
            raise ValueError(f"the server answered {lines[0].decode(errors='replace')!r}")
        self._head = True
        length = None
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"transfer-encoding":
                self._chunked = b"chunked" in value.lower()
            elif name == b"content-length":
                length = int(value)
        if not self._chunked:
            if length is None:
                raise ValueError("an answer with neither chunked framing nor Content-Length")
            self._left = length
            self.done = length == 0

    def _body(self, wire: bytes, pos: int) -> tuple[bytes, int]:
        """Decode what the framing allows from wire[pos:]: (body bytes, where decoding stopped)."""
        n = len(wire)
        if not self._chunked:
            take = min(self._left, n - pos)
            self._left -= take
            self.done = self._left == 0
            return wire[pos : pos + take], pos + take
        parts = []
        left = self._left  # of the current chunk's data and the CRLF after it
        while pos < n:
            if left:
                stop = min(n, pos + left)
                if left > 2:
                    parts.append(wire[pos : min(stop, pos + left - 2)])
                left -= stop - pos
                pos = stop
                if left:
                    break
            eol = wire.find(b"\r\n", pos)
            if eol < 0:
                break
            size = int(wire[pos:eol].split(b";", 1)[0], 16)
            if size == 0:  # the last chunk, then (no) trailers and a blank line
                end = wire.find(b"\r\n\r\n", pos)
                if end < 0:
                    break
                self.done = True
                pos = end + 4
                break
            left = size + 2
            pos = eol + 2
        self._left = left
        return b"".join(parts), pos

    def _events(self, body: bytes, now: float) -> None:
        """Stamp the content tokens of the SSE events this read completed (all at `now`)."""
        text = self._sse + body if self._sse else body
        cut = len(text) if self.done else text.rfind(b"\n\n")
        if cut < 0:
            self._sse = text
            return
        self._sse = text[cut + 2 :]
        # One content delta per event: count them in one pass over the complete events.
        count = len(_CONTENT.findall(text, 0, cut))
        if count:
            self.tokens.extend([now] * count)


class Conn:
    """One keep-alive connection to a target, and the request in flight on it."""

    __slots__ = ("target", "request", "blocking", "sock", "response", "left", "retried")

    def __init__(self, target: Target, request: Request) -> None:
        self.target = target
        self.request = request
        self.blocking = False
        self.sock = self._connect()
        self.response: Response | None = None
        self.left = 0  # requests still to send in this drive
        self.retried = False

    def _connect(self) -> socket.socket:
        sock = socket.create_connection((self.target.host, self.target.port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(self.blocking)
        return sock

    def set_blocking(self, blocking: bool) -> None:
        self.blocking = blocking
        self.sock.setblocking(blocking)

    def send(self) -> None:
        """Send the request; a server that closed the idle connection gets a new one."""
        rid, data = self.request.next()
        self.response = Response(time.perf_counter(), rid)
        try:
            sent = self.sock.send(data)
        except (BrokenPipeError, ConnectionResetError):
            self.reconnect()
            return
        if sent < len(data):  # a full send buffer: rare for a few hundred bytes
            self.sock.setblocking(True)
            self.sock.sendall(data[sent:])
            self.sock.setblocking(self.blocking)

    def reconnect(self) -> None:
        if self.retried:
            raise ConnectionError(f"{self.target.name}: the server closed the connection")
        self.retried = True
        self.sock.close()
        self.sock = self._connect()
        self.send()

    def readable(self, now: float = 0.0) -> bool:
        """Read what arrived at `now` (0: when the read returns); True once the answer in
        flight is complete."""
        try:
            data = self.sock.recv(65536)
        except BlockingIOError:
            return False
        except ConnectionResetError:
            data = b""
        if not now:
            now = time.perf_counter()
        r = self.response
        if r is None:  # idle: only a close may arrive; reconnect before the next send
            if data:
                raise ValueError(f"{self.target.name}: bytes between answers")
            self.sock.close()
            self.sock = self._connect()
            return False
        if not data:
            if r.first_byte:
                raise ConnectionError(f"{self.target.name}: the server closed mid-answer")
            self.reconnect()  # closed while idle, noticed only now: send again
            return False
        if not r.feed(data, now):
            return False
        if not r.tokens:
            raise ValueError(f"{self.target.name}: the answer carried no content token")
        self.retried = False
        return True


def drive(conns: list[Conn], count: int, pause_s: float, *, record: bool) -> None:
    """`count` requests on each connection, each a closed loop, all from one selector; one
    connection alone reads blocking instead (half the system calls per read)."""
    if len(conns) == 1:
        _drive_one(conns[0], count, pause_s, record=record)
        return
    pauses: list[tuple[float, int, Conn]] = []  # (when the next request is due, tiebreak, conn)
    sel = selectors.DefaultSelector()
    socks: dict[Conn, socket.socket] = {}
    try:
        for c in conns:
            c.left = count
            if count:
                c.send()
                sel.register(c.sock, selectors.EVENT_READ, c)
                socks[c] = c.sock
        active = len(socks)
        seq = 0
        while active:
            timeout = max(0.0, pauses[0][0] - time.perf_counter()) if pauses else None
            events = sel.select(timeout)
            now = time.perf_counter()
            for key, _ in events:
                c = key.data
                if c.readable(now):
                    assert c.response is not None
                    if record:
                        c.target.record(c.response)
                    c.response = None
                    c.left -= 1
                    if not c.left:
                        active -= 1
                    elif pause_s:
                        seq += 1
                        heapq.heappush(pauses, (now + pause_s, seq, c))
                    else:
                        c.send()
                _follow(sel, socks, c)
            while pauses and pauses[0][0] <= time.perf_counter():
                c = heapq.heappop(pauses)[2]
                c.send()
                _follow(sel, socks, c)
    finally:
        sel.close()


def _follow(sel: selectors.BaseSelector, socks: dict[Conn, socket.socket], c: Conn) -> None:
    """Watch the new socket of a connection that reconnected."""
    if c.sock is not socks[c]:
        sel.unregister(socks[c])
        sel.register(c.sock, selectors.EVENT_READ, c)
        socks[c] = c.sock


def _drive_one(c: Conn, count: int, pause_s: float, *, record: bool) -> None:
    """`drive` for one connection: a blocking read returns with the data, no select first."""
    c.set_blocking(True)
    try:
        for i in range(count):
            if i and pause_s:
                time.sleep(pause_s)
            c.send()
            while not c.readable():
                pass
            assert c.response is not None
            if record:
                c.target.record(c.response)
            c.response = None
    finally:
        c.set_blocking(False)


def measure(
    targets: list[Target],
    *,
    concurrency: int,
    max_tokens: int,
    prompt_words: int,
    rounds: int,
    per_round: int,
    warmup: int,
    pause_s: float,
    pids: dict[str, int],
    on_warm: Callable[[], None] | None = None,
) -> None:
    """Warm up every target, then `rounds` interleaved rounds; results land in `targets`.
    `on_warm` is called between the two."""
    pools: list[list[Conn]] = []
    try:
        for t in targets:
            request = Request(request_bytes(t.host, max_tokens, prompt_words))
            pools.append([])
            for _ in range(concurrency):
                pools[-1].append(Conn(t, request))
        for pool in pools:
            drive(pool, warmup, pause_s, record=False)
        if on_warm is not None:
            on_warm()
        for _ in range(rounds):
            for t, pool in zip(targets, pools, strict=True):
                before = {name: cpu_seconds(pid) for name, pid in pids.items()}
                start = time.perf_counter()
                drive(pool, -(-per_round // concurrency), pause_s, record=True)
                t.wall_s += time.perf_counter() - start
                for name, pid in pids.items():
                    t.cpu_s[name] = t.cpu_s.get(name, 0.0) + cpu_seconds(pid) - before[name]
    finally:
        for pool in pools:
            for c in pool:
                c.sock.close()


def _pcts(values: Any, qs: tuple[int, ...]) -> dict[str, float] | None:
    """Percentiles (nearest rank), None for no values."""
    if not len(values):
        return None
    ordered = sorted(values)
    return {f"p{q}": ordered[rank_index(len(ordered), q)] for q in qs}


def summarize(targets: list[Target]) -> list[dict[str, Any]]:
    """All the numbers of one run, per target; "added" is over the first target."""
    rows: list[dict[str, Any]] = []
    for t in targets:
        row: dict[str, Any] = {
            "name": t.name,
            "requests": t.requests,
            "req_per_s": t.requests / t.wall_s if t.wall_s else None,
            "first_byte_ms": _pcts(t.first_byte_ms, (50, 90, 99)),
            "ttft_ms": _pcts(t.ttft_ms, (50, 90, 99)),
            "itl_ms": _pcts(t.itl_ms, (50, 99)),
            "cpu_ms_per_request": {
                name: cpu / t.requests * 1e3 for name, cpu in t.cpu_s.items() if t.requests
            },
            "added_over": None,
            "added_ms": None,
        }
        if rows:
            base = rows[0]
            row["added_over"] = base["name"]
            row["added_ms"] = {
                "ttft_p50": _diff(row, base, "ttft_ms", "p50"),
                "ttft_p99": _diff(row, base, "ttft_ms", "p99"),
                "itl_p99": _diff(row, base, "itl_ms", "p99"),
                "first_byte_p50": _diff(row, base, "first_byte_ms", "p50"),
            }
        rows.append(row)
    return rows


def _diff(row: dict[str, Any], base: dict[str, Any], series: str, q: str) -> float | None:
    if row[series] is None or base[series] is None:
        return None
    return float(row[series][q] - base[series][q])


def _f(value: float | None, fmt: str = ".2f") -> str:
    return "-" if value is None else format(value, fmt)


def report(runs: list[dict[str, Any]]) -> str:
    """The plain-text report: per concurrency level, a line per target."""
    lines = []
    for run in runs:
        lines.append(f"concurrency {run['concurrency']}:")
        for row in run["targets"]:
            fb, tt, itl = row["first_byte_ms"] or {}, row["ttft_ms"] or {}, row["itl_ms"] or {}
            line = (
                f"{row['name']:>8}: first byte p50 {_f(fb.get('p50'))} p90 {_f(fb.get('p90'))}"
                f" p99 {_f(fb.get('p99'))} | TTFT p50 {_f(tt.get('p50'))}"
                f" p90 {_f(tt.get('p90'))} p99 {_f(tt.get('p99'))}"
                f" | ITL p50 {_f(itl.get('p50'))} p99 {_f(itl.get('p99'))} ms"
                f" | {_f(row['req_per_s'], '.0f')} req/s"
            )
            if row["cpu_ms_per_request"]:
                line += " | CPU/request " + " ".join(
                    f"{name} {ms:.2f}" for name, ms in row["cpu_ms_per_request"].items()
                )
                line += " ms"
            lines.append(line)
            if row["added_ms"] is not None:
                a = row["added_ms"]
                lines.append(
                    f"{'':>8}  added over {row['added_over']}: TTFT p50 {_f(a['ttft_p50'], '+.2f')}"
                    f" p99 {_f(a['ttft_p99'], '+.2f')}, ITL p99 {_f(a['itl_p99'], '+.2f')},"
                    f" first byte p50 {_f(a['first_byte_p50'], '+.2f')} ms"
                )
            lg = row.get("legs")
            if lg is not None and lg["joined"]:
                rq, rs = lg["request_leg_ms"] or {}, lg["response_leg_ms"] or {}
                bo = lg.get("both_legs_ms") or {}
                lines.append(
                    f"{'':>8}  legs ({lg['joined']} requests): request (send → stand-in read)"
                    f" p50 {_f(rq.get('p50'))} p99 {_f(rq.get('p99'))}, response (stand-in"
                    f" first token → client) p50 {_f(rs.get('p50'))} p99 {_f(rs.get('p99'))},"
                    f" both p50 {_f(bo.get('p50'))} p99 {_f(bo.get('p99'))} ms"
                )
                if "added_ms" in lg:
                    a = lg["added_ms"]
                    lines.append(
                        f"{'':>8}  legs added over {row['added_over']}: request p50"
                        f" {_f(a['request_p50'], '+.2f')} p99 {_f(a['request_p99'], '+.2f')},"
                        f" response p50 {_f(a['response_p50'], '+.2f')}"
                        f" p99 {_f(a['response_p99'], '+.2f')}, both p50"
                        f" {_f(a.get('both_p50'), '+.2f')} p99 {_f(a.get('both_p99'), '+.2f')} ms"
                    )
        own = run.get("edge_own_ms")
        if own is not None:
            lines.append(
                f"{'':>8}  the edge's own histograms ({own['requests']:.0f} requests):"
                f" added TTFT p50 {_f(own['added_p50'])} p99 {_f(own['added_p99'])},"
                f" relay delay per chunk p50 {_f(own['relay_delay_p50'])}"
                f" p99 {_f(own['relay_delay_p99'])}, loop read delay"
                f" p50 {_f(own.get('read_delay_p50'))} p99 {_f(own.get('read_delay_p99'))} ms;"
                f" {own.get('gc_pauses', 0):.0f} garbage collections, the longest"
                f" ≤ {_f(own.get('gc_pause_max'))} ms"
            )
    return "\n".join(lines)


def markdown(result: dict[str, Any]) -> str:
    """The Markdown report of a `--spawn` run: its conditions, then one table."""
    cfg = result["config"]
    pin = result["pinning"]
    pinning = (
        "edge on CPU {edge}, stand-in and client on CPU {client}".format(
            edge=",".join(map(str, pin["edge"])), client=",".join(map(str, pin["client"]))
        )
        if pin
        else "none"
    )
    out = [
        "# Edge-added latency",
        "",
        f"- Command: `{result['command']}`",
        f"- Date: {result['date']}; {result['machine']}",
        f"- Edge: `{' '.join(result['edge_command'])}` (cwd {result['edge_cwd']})",
        f"- CPU pinning: {pinning}",
        f"- {cfg['max_tokens']} tokens per answer, {cfg['prompt_words']}-word prompts;"
        f" {cfg['rounds']} interleaved rounds of {cfg['per_round']} requests per target,"
        f" {cfg['warmup']} warm-up requests per connection, pause {cfg['pause_ms']} ms",
        f"- Client priority: {cfg.get('client_priority', 'normal')}",
        f"- Stand-in profile: {cfg.get('sim_profile', 'instant')}",
        "- All times in ms; added = edge percentile − direct percentile. ITL gaps of tokens that"
        " arrived in one read count as 0.",
        "",
        "| concurrency | target | requests | TTFT p50 | TTFT p90 | TTFT p99 | ITL p50 | ITL p99 |"
        " added TTFT p50 | added TTFT p99 | added ITL p99 | req/s | CPU/req sim | CPU/req edge |"
        " CPU/req client |",
        "| ---: | --- |" + " ---: |" * 13,
    ]
    for run in result["runs"]:
        for row in run["targets"]:
            tt, itl = row["ttft_ms"] or {}, row["itl_ms"] or {}
            added = row["added_ms"] or {}
            cpu = row["cpu_ms_per_request"]
            cells = [
                str(run["concurrency"]),
                row["name"],
                str(row["requests"]),
                *(_f(tt.get(q)) for q in ("p50", "p90", "p99")),
                _f(itl.get("p50")),
                _f(itl.get("p99")),
                _f(added.get("ttft_p50"), "+.2f"),
                _f(added.get("ttft_p99"), "+.2f"),
                _f(added.get("itl_p99"), "+.2f"),
                _f(row["req_per_s"], ".0f"),
                *(_f(cpu.get(name)) for name in ("sim", "edge", "client")),
            ]
            out.append("| " + " | ".join(cells) + " |")
    out += _legs_table(result["runs"])
    owns = [
        (run["concurrency"], run["edge_own_ms"]) for run in result["runs"] if run.get("edge_own_ms")
    ]
    if owns:
        out += [
            "",
            "The edge's own timing, from its histograms (`quicedge_edge_added_seconds`: the"
            " request's read to its upstream send plus the first token's read to its hand-over;"
            " `quicedge_relay_delay_seconds`: each content chunk's read to its hand-over;"
            " `quicedge_loop_read_delay_seconds`: how long a probe byte waited on a socket before"
            " the loop read it, the wait in front of every read; `quicedge_gc_pause_seconds`:"
            " each garbage collection, the longest given as its bucket's bound), scraped before"
            " and after the measured rounds, quantiles interpolated within buckets:",
            "",
            "| concurrency | requests | added TTFT p50 | added TTFT p99 | chunks |"
            " relay delay p50 | relay delay p99 | read delay p50 | read delay p99 |"
            " collections | longest collection ≤ |",
            "| ---: |" + " ---: |" * 10,
        ]
        for n, own in owns:
            cells = [
                str(n), f"{own['requests']:.0f}", _f(own["added_p50"]), _f(own["added_p99"]),
                f"{own['chunks']:.0f}", _f(own["relay_delay_p50"]), _f(own["relay_delay_p99"]),
                _f(own.get("read_delay_p50")), _f(own.get("read_delay_p99")),
                f"{own.get('gc_pauses', 0):.0f}", _f(own.get("gc_pause_max")),
            ]  # fmt: skip
            out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def _legs_table(runs: list[dict[str, Any]]) -> list[str]:
    rows = [(run["concurrency"], row) for run in runs for row in run["targets"] if row.get("legs")]
    if not rows:
        return []
    out = [
        "",
        "The legs of each request (`bench.legs`), from the client's stamps and the stand-in's"
        " (`--record-timings`): request = client send → the stand-in's read; response = the"
        " stand-in's first-token write → the client's read; both = their sum per request."
        " Added = edge − direct, per percentile:",
        "",
        "| concurrency | target | joined | request p50 | request p99 | response p50 |"
        " response p99 | both p50 | both p99 | added request p50 | added request p99 |"
        " added response p50 | added response p99 | added both p50 | added both p99 |",
        "| ---: | --- |" + " ---: |" * 13,
    ]
    for n, row in rows:
        lg = row["legs"]
        rq, rs, a = lg["request_leg_ms"] or {}, lg["response_leg_ms"] or {}, lg.get("added_ms", {})
        bo = lg.get("both_legs_ms") or {}
        cells = [
            str(n), row["name"], str(lg["joined"]), _f(rq.get("p50")), _f(rq.get("p99")),
            _f(rs.get("p50")), _f(rs.get("p99")), _f(bo.get("p50")), _f(bo.get("p99")),
            *(_f(a.get(k), "+.2f") for k in ("request_p50", "request_p99", "response_p50",
                                             "response_p99", "both_p50", "both_p99")),
        ]  # fmt: skip
        out.append("| " + " | ".join(cells) + " |")
    return out


# --- --spawn: the stand-in and the edge as child processes ---


@dataclass
class Spawned:
    sim_url: str
    edge_url: str
    metrics_url: str
    pids: dict[str, int]
    edge_cmd: list[str]
    pinning: dict[str, list[int]] | None
    references: dict[str, str] = field(default_factory=dict)
    """Reference proxies (`--reference`): name → base URL."""


@contextmanager
def spawned(args: argparse.Namespace, out: Path) -> Iterator[Spawned]:
    """A stand-in and an edge in front of it, listening; both stopped on the way out."""
    edge_cpus, others = split_cpus(args.pin)
    with ExitStack() as stack:
        sim, sim_url = start_stand_in(
            stack, log=out / "sim.log", cpus=others, profile=args.sim_profile,
            extra=["--time-scale", str(args.sim_time_scale),
                   "--record-timings", str(_requests_sent(args))],
        )  # fmt: skip
        http, admin = free_port(), free_port()
        edge_cmd = [
            args.edge_python, "-m", "edge.cli", "serve", "--backend", sim_url,
            "--http", f"127.0.0.1:{http}", "--h3", f"127.0.0.1:{free_port(socket.SOCK_DGRAM)}",
            "--tcp", f"127.0.0.1:{free_port()}", "--admin", f"127.0.0.1:{admin}",
            *args.edge_arg,
        ]  # fmt: skip
        edge_cwd = Path(args.edge_cwd).resolve()
        edge = start(
            "the edge", edge_cmd, log=out / "edge.log", cpus=edge_cpus, cwd=edge_cwd,
            env=dict(os.environ, PYTHONPATH=str(edge_cwd)),
        )  # fmt: skip
        stack.callback(stop, edge)
        wait_listening(edge, http)
        references: dict[str, str] = {}
        pids = {"sim": sim.proc.pid, "edge": edge.proc.pid, "client": os.getpid()}
        for name in args.reference:
            port = free_port()
            ref = reference_proxies.reference(name, port, sim_url, out / name)
            child = start(
                name, ref.command, log=out / f"{name}.log", cpus=edge_cpus,
                env=dict(os.environ, **ref.env),
            )  # fmt: skip
            stack.callback(stop, child)
            wait_listening(child, port)
            references[name] = f"http://127.0.0.1:{port}"
            pids[name] = child.proc.pid
        if others:
            os.sched_setaffinity(0, others)
        pinning = (
            {"edge": sorted(edge_cpus), "sim": sorted(others), "client": sorted(others)}
            if edge_cpus and others
            else None
        )
        yield Spawned(
            sim_url, f"http://127.0.0.1:{http}", f"http://127.0.0.1:{admin}/metrics", pids,
            edge_cmd, pinning, references,
        )  # fmt: skip


def _on_sigterm(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwind, so that the children are stopped


def run_spawn(args: argparse.Namespace, config: dict[str, Any]) -> dict[str, Any]:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _on_sigterm)
    runs = []
    with spawned(args, out) as s:
        args.edge_metrics = args.edge_metrics or s.metrics_url
        args.sim_timings = args.sim_timings or s.sim_url
        for n in args.concurrency:
            targets = [_target(f"direct={s.sim_url}"), _target(f"edge={s.edge_url}")]
            targets += [_target(f"{name}={url}") for name, url in s.references.items()]
            runs.append(_measure_level(targets, n, args, {**s.pids, **dict(args.cpu_pid)}))
            print(report(runs[-1:]), flush=True)
    result = {
        "command": shlex.join(["python", "-m", "bench.edge_latency", *args.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "machine": f"{os.cpu_count()} CPUs, Python {platform.python_version()}, load average"
        f" {' '.join(f'{x:.2f}' for x in os.getloadavg())} at the end",
        "edge_command": s.edge_cmd,
        "edge_cwd": str(Path(args.edge_cwd).resolve()),
        "pinning": s.pinning,
        "pids": s.pids,
        "config": config,
        "runs": runs,
    }
    (out / "edge_latency.md").write_text(markdown(result))
    (out / "edge_latency.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out / 'edge_latency.md'} and {out / 'edge_latency.json'}")
    return result


def _requests_sent(args: argparse.Namespace) -> int:
    """At most how many requests a run sends (every level, every target): what the stand-in
    keeps timings of."""
    rounds = args.rounds
    per_level = [n * (args.warmup + rounds * -(-args.per_round // n)) for n in args.concurrency]
    return (2 + len(args.reference)) * sum(per_level) + 100


def _measure_level(
    targets: list[Target], concurrency: int, args: argparse.Namespace, pids: dict[str, int]
) -> dict[str, Any]:
    """One concurrency level; its run record, with the edge's own histograms when known."""
    url = args.edge_metrics
    before: dict[str, edge_histograms.Buckets] = {}

    def warm() -> None:
        if url:
            before.update(edge_histograms.scrape(url))

    measure(
        targets,
        concurrency=concurrency,
        max_tokens=args.max_tokens,
        prompt_words=args.prompt_words,
        rounds=args.rounds,
        per_round=args.per_round,
        warmup=args.warmup,
        pause_s=args.pause_ms / 1e3,
        pids=pids,
        on_warm=warm,
    )
    run: dict[str, Any] = {"concurrency": concurrency, "targets": summarize(targets)}
    if url:
        d = edge_histograms.delta(edge_histograms.scrape(url), before)
        run["edge_own_ms"] = edge_histograms.summary(d)
    if args.sim_timings:
        add_legs(run["targets"], targets, legs.fetch(args.sim_timings))
    return run


def add_legs(rows: list[dict[str, Any]], targets: list[Target], stamps: legs.Stamps) -> None:
    """Each target's request and response legs (`bench.legs`), and what it adds over the first."""
    for row, t in zip(rows, targets, strict=True):
        row["legs"] = legs.legs(t.sent, stamps)
        if row is not rows[0]:
            row["legs"]["added_ms"] = legs.added(row["legs"], rows[0]["legs"])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.edge_latency",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("targets", nargs="*", type=_target, help="NAME=http://host:port")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1], metavar="N",
                   help="connections per target; several: one run each (1)")  # fmt: skip
    p.add_argument("--max-tokens", type=int, default=1)
    p.add_argument("--prompt-words", type=int, default=64)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--per-round", type=int, default=50, help="requests per target and round")
    p.add_argument("--warmup", type=int, default=10, help="requests per connection")
    p.add_argument("--pause-ms", type=float, default=2.0, help="between a connection's requests")
    p.add_argument("--cpu-pid", type=_pid, action="append", default=[], metavar="NAME=PID")
    p.add_argument("--json", metavar="PATH", help="also write the numbers as JSON")
    p.add_argument("--edge-metrics", metavar="URL",
                   help="the edge's admin /metrics: also report its own histograms")  # fmt: skip
    p.add_argument("--sim-timings", metavar="URL",
                   help="a stand-in run with --record-timings (its base URL): also report each"
                   " request's legs (bench.legs)")  # fmt: skip
    p.add_argument("--no-rt", dest="rt", action="store_false",
                   help="run the client at normal priority, not SCHED_FIFO")  # fmt: skip
    g = p.add_argument_group("--spawn: start a stand-in and an edge, measure direct vs edge")
    g.add_argument("--spawn", action="store_true")
    g.add_argument("--out", default="bench-out/edge-latency", help="edge_latency.md/.json here")
    g.add_argument("--no-pin", dest="pin", action="store_false", help="no CPU pinning")
    g.add_argument(
        "--sim-profile",
        default="instant",
        help="the stand-in's timing profile (instant: no simulated GPU time)",
    )
    g.add_argument("--sim-time-scale", type=float, default=1.0,
                   help="multiply the profile's durations")  # fmt: skip
    g.add_argument("--edge-arg", action="append", default=[], metavar="ARG",
                   help="one more argument to `serve` (repeat; --edge-arg=--loop ...)")  # fmt: skip
    g.add_argument("--edge-python", default=sys.executable, help="the edge's interpreter")
    g.add_argument("--edge-cwd", default=str(REPO), help="the tree whose edge runs")
    g.add_argument("--reference", action="append", default=[],
                   choices=reference_proxies.REFERENCES,
                   help="also measure this compiled proxy in front of the same stand-in, on the"
                   " edge's CPU (repeat; bench.reference_proxies)")  # fmt: skip
    return p


def client_priority(realtime: bool) -> str:
    """Make this process real-time (SCHED_FIFO 10, children reset to normal) when asked and
    allowed; say what it runs at."""
    if not realtime:
        return "normal"
    try:
        policy = os.SCHED_FIFO | getattr(os, "SCHED_RESET_ON_FORK", 0)
        os.sched_setscheduler(0, policy, os.sched_param(10))
    except (AttributeError, OSError) as exc:
        return f"normal (real-time refused: {exc})"
    return "SCHED_FIFO 10"


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    if args.spawn == bool(args.targets):
        p.error("give targets (NAME=http://host:port ...) or --spawn, not both")
    if min(args.concurrency) < 1 or args.rounds < 1 or args.per_round < 1 or args.warmup < 0:
        p.error("--concurrency, --rounds and --per-round must be >= 1, --warmup >= 0")
    config = {
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "prompt_words": args.prompt_words,
        "rounds": args.rounds,
        "per_round": args.per_round,
        "warmup": args.warmup,
        "pause_ms": args.pause_ms,
        "client_priority": client_priority(args.rt),
    }
    if args.spawn:
        config["sim_profile"] = f"{args.sim_profile} (time scale {args.sim_time_scale:g})"
    try:
        if args.spawn:
            result = run_spawn(args, config)
        else:
            result = {"config": config, "runs": []}
            for n in args.concurrency:
                targets = [t.fresh() for t in args.targets]
                result["runs"].append(_measure_level(targets, n, args, dict(args.cpu_pid)))
            print(report(result["runs"]))
    except (OSError, ValueError, RuntimeError) as exc:
        print(f"edge_latency: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("edge_latency: interrupted", file=sys.stderr)
        return 130
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
