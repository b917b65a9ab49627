"""Instructions the HTTP/3 server executes per connection (handshake + one POST), full and 0-RTT,
counted by valgrind (cachegrind); prints one line per kind.

    .venv/bin/python -m tools.h3_handshake_instructions [--few 10] [--many 60] [--edge-cwd DIR]

CPU time on a shared two-core machine moves by ±10 % from run to run; instruction counts do not,
so they tell whether a change did less work (they leave out cache misses and system calls, so
they are not time). `quicedge serve --demo` runs under `valgrind --tool=cachegrind` (`--edge-cwd`:
another checkout's, for before/after) and this process drives it with aioquic clients, one
connection at a time, as `tools.h3_handshake_cpu` does. Each kind runs twice, with `--few` and
`--many` connections, and the difference of the two counts divided by the difference of the
connections is the cost of one connection: start-up and shut-down cancel out. An answer other
than 2xx ends the run (exit status 1, naming the status): its count would be an error's.
Needs valgrind (`apt-get install valgrind`). A measurement, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from aioquic.tls import SessionTicket

from certs import ensure_dev_certificates
from tools import h3_handshake_cpu
from tools.h3_handshake_cpu import first_ticket
from tools.handshakes import BadStatus, free_port, wait_for_ready

REPO = Path(__file__).resolve().parent.parent


async def drive(
    port: int, ca: Path, *, n: int, ticket: SessionTicket | None, timeout: float = 10.0
) -> int:
    """`n` connections one after another, each one `POST /generate` (0-RTT on each previous
    ticket when `ticket` is given); how many were accepted in 0-RTT. BadStatus on the first
    answer that is not 2xx (`tools.h3_handshake_cpu.drive`)."""
    _, early = await h3_handshake_cpu.drive(port, ca, n=n, ticket=ticket, timeout=timeout)
    return early


def count(kind: str, connections: int, *, cwd: Path, ca: Path) -> tuple[int, int]:
    """Instructions of one `serve --demo` process that served `connections` of `kind` (plus the
    one full handshake that fetches the first ticket of a 0-RTT chain), and how many of them
    were accepted in 0-RTT."""
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        raise SystemExit("needs valgrind (apt-get install valgrind)")
    port = free_port(socket.SOCK_DGRAM)
    command = [
        valgrind, "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null",
        sys.executable, "-m", "edge.cli", "serve", "--demo", "--h3", f"127.0.0.1:{port}",
        "--tcp", "off", "--admin", "off",
    ]  # fmt: skip
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(
            command, cwd=cwd, stdout=subprocess.PIPE, stderr=err,
            env=dict(os.environ, PYTHONPATH=str(cwd)),
        )  # fmt: skip
        try:
            wait_for_ready(proc, timeout=300, what="serve under valgrind")
            ticket = asyncio.run(first_ticket(port, ca)) if kind == "0-RTT" else None
            early = asyncio.run(drive(port, ca, n=connections, ticket=ticket, timeout=120))
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(300)
        err.seek(0)
        text = err.read().decode(errors="replace")
    found = re.search(r"I\s+refs:\s+([\d,]+)", text)
    if found is None:
        raise RuntimeError(f"no instruction count: {text[-500:]}")
    return int(found.group(1).replace(",", "")), early


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tools.h3_handshake_instructions", description=__doc__.split("\n")[0]
    )
    p.add_argument("--few", type=int, default=10, help="connections in the short run (10)")
    p.add_argument("--many", type=int, default=60, help="connections in the long run (60)")
    p.add_argument("--edge-cwd", type=Path, default=REPO, help="the checkout whose serve runs")
    p.add_argument("--kinds", nargs="+", default=["full", "0-RTT"], choices=["full", "0-RTT"])
    args = p.parse_args(argv)
    if not 0 <= args.few < args.many:
        p.error("--few must be >= 0 and below --many")
    ca = ensure_dev_certificates().ca_cert
    cwd = args.edge_cwd.resolve()
    print(f"instructions per connection of `serve --demo` from {cwd}")
    for kind in args.kinds:
        try:
            few, early_few = count(kind, args.few, cwd=cwd, ca=ca)
            many, early_many = count(kind, args.many, cwd=cwd, ca=ca)
        except BadStatus as exc:
            print(f"tools.h3_handshake_instructions: {exc}", file=sys.stderr)
            return 1
        per = (many - few) / (args.many - args.few)
        print(f"{kind:<6} {per / 1e6:8.3f} M instructions per connection "
              f"({args.few}: {few:,}, {args.many}: {many:,}; accepted in 0-RTT: "
              f"{early_few}/{args.few}, {early_many}/{args.many})", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
