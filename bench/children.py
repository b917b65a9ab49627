"""The child processes a bench starts: a stand-in, edges, reference proxies; each pinned to its
CPUs, logging to a file, waited for until it listens and always stopped on the way out."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default range starts here


_EPHEMERAL_LOW = _ephemeral_low()
_picks = random.Random()
_given: set[int] = set()
"""Ports this process handed out, not handed out again: two servers of one process (a test's
stand-in and its edge) drew the same port now and then, and the second to bind it failed with
"Address already in use" (or, binding with SO_REUSEPORT, silently shared it)."""


def _share() -> tuple[int, int]:
    """The ports below the kernel's ephemeral range this process draws from: with test runners
    in parallel (pytest-xdist's workers), each its own slice, so that they never draw alike."""
    low, high = max(1024, _EPHEMERAL_LOW - 16384), _EPHEMERAL_LOW - 1
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if worker.startswith("gw") and worker[2:].isdigit() and count.isdigit() and int(count) > 1:
        span = (high - low + 1) // int(count)
        low += int(worker[2:]) % int(count) * span
        high = low + span - 1
    return low, high


def free_port(kind: int = socket.SOCK_STREAM) -> int:
    """A port on 127.0.0.1 that was free a moment ago (TCP by default, SOCK_DGRAM for UDP).

    Taken below the kernel's ephemeral range: a port from inside it (what binding port 0 gives)
    can be handed to any process's outgoing connection between this check and the bind that
    needs it, which made a test's server fail with "Address already in use"."""
    low, high = _share()
    if len(_given) > (high - low) * 3 // 4:  # nearly all given: start over rather than fail
        _given.clear()
    for _ in range(100 if high - low >= 1024 else 0):
        port = _picks.randint(low, high)
        if port in _given:
            continue
        with socket.socket(socket.AF_INET, kind) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            _given.add(port)
            return port
    with socket.socket(socket.AF_INET, kind) as s:  # no room below the range: the kernel's pick
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Child:
    """A started child: its name in errors, its process and its log file."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path


def start(
    name: str, cmd: list[str], *, log: Path, cpus: set[int] | None, cwd: Path | None = None,
    env: dict[str, str] | None = None,
) -> Child:  # fmt: skip
    """Start a child with its output in `log`; pinned to `cpus` by setting our own affinity
    first (a child inherits it from the fork on, before it can start a thread)."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=cwd, env=env)
    return Child(name, proc, log)


def wait_listening(child: Child, port: int, timeout: float = 60.0) -> None:
    """Until `port` on 127.0.0.1 accepts a connection; RuntimeError with the log's tail when the
    child exits first or `timeout` s pass."""
    deadline = time.monotonic() + timeout
    while True:
        if child.proc.poll() is not None:
            raise RuntimeError(
                f"{child.name} exited with {child.proc.returncode}: {tail(child.log)}"
            )
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{child.name} not listening on :{port} after {timeout}s"
                ) from None
            time.sleep(0.05)


def tail(log: Path) -> str:
    """The last five lines of a log, on one line."""
    text = log.read_text(errors="replace").strip().splitlines()
    return " / ".join(text[-5:]) or "(no output)"


def stop(child: Child) -> None:
    """SIGTERM (both drain and exit), SIGKILL if it does not exit in time; always reaped."""
    proc = child.proc
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def split_cpus(pin: bool) -> tuple[set[int] | None, set[int] | None]:
    """(the edge's CPU, everyone else's) when pinning on a machine with two CPUs or more, else
    (None, None). The caller's own affinity is put back by `start_stand_in`'s stack."""
    cpus = sorted(os.sched_getaffinity(0))
    if not pin or len(cpus) < 2:
        return None, None
    return {cpus[-1]}, set(cpus[:-1])


def start_stand_in(
    stack: ExitStack, *, log: Path, cpus: set[int] | None, profile: str = "instant",
    extra: list[str] | tuple[str, ...] = (), name: str = "s1",
) -> tuple[Child, str]:  # fmt: skip
    """A `backends.sim` stand-in on a free port, listening; stopped (and this process's CPU
    affinity restored) when `stack` closes. Its child and its URL."""
    stack.callback(os.sched_setaffinity, 0, set(os.sched_getaffinity(0)))
    port = free_port()
    sim = start(
        "the stand-in",
        [sys.executable, "-m", "backends.sim", "--port", str(port), "--name", name,
         "--profile", profile, *extra],
        log=log, cpus=cpus, cwd=REPO,
    )  # fmt: skip
    stack.callback(stop, sim)
    wait_listening(sim, port)
    return sim, f"http://127.0.0.1:{port}"
