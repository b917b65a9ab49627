"""Signals that reach `quicedge serve` while it, or one of its workers, is still starting: a
SIGHUP is held until the handler is in place and then reloads, it never ends a process; and a
worker left dead makes the exit status say so."""

from __future__ import annotations

import os
import re
import selectors
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest

from tests.helpers import child_output, free_port, free_udp_port
from transport.workers import exit_status

RELOADS = 'quicedge_tls_reloads_total{outcome="applied"}'


def sighup_held(pid: int) -> bool:
    """Whether process `pid` blocks SIGHUP now (its `SigBlk` mask in /proc)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("SigBlk:"):
                return bool(int(line.split()[1], 16) & (1 << (signal.SIGHUP - 1)))
    return False


class Starting:
    """`quicedge serve` in a child process, signalled by the test before it is ready."""

    def __init__(self, *args: str) -> None:
        self.admin_port = free_port()
        cmd = [
            sys.executable, "-m", "edge.cli", "serve",
            "--h3", f"127.0.0.1:{free_udp_port()}",
            "--tcp", f"127.0.0.1:{free_port()}",
            "--admin", f"127.0.0.1:{self.admin_port}",
            *args,
        ]  # fmt: skip
        self.stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.stderr)
        assert self.proc.stdout is not None
        self._selector = selectors.DefaultSelector()
        self._selector.register(self.proc.stdout.fileno(), selectors.EVENT_READ)
        self._pending = b""
        self.lines: list[str] = []

    def wait_held(self, timeout: float = 30.0) -> None:
        """Until serve holds SIGHUP: a signal before that would meet Python's start-up, which
        no program can guard."""
        deadline = time.monotonic() + timeout
        while not sighup_held(self.proc.pid):
            assert self.proc.poll() is None, f"serve exited: {self.errors()}"
            assert time.monotonic() < deadline, "serve never held SIGHUP"
            time.sleep(0.005)

    def ready(self, wait: float) -> bool:
        """Read what serve prints within `wait` seconds; whether it has said `ready`."""
        deadline = time.monotonic() + wait
        while "ready" not in self.lines:
            left = deadline - time.monotonic()
            if left <= 0 or not self._selector.select(timeout=left):
                return False
            chunk = os.read(self.proc.stdout.fileno(), 65536)  # type: ignore[union-attr]
            if not chunk:
                pytest.fail(f"serve exited ({self.proc.wait()}): {self.lines} {self.errors()}")
            self._pending += chunk
            *done, self._pending = self._pending.split(b"\n")
            self.lines.extend(line.decode() for line in done)
        return True

    def ready_under_sighups(self, every: float, timeout: float = 60.0) -> int:
        """Send SIGHUP every `every` seconds until serve is ready; how many were sent."""
        sent = 0
        deadline = time.monotonic() + timeout
        while not self.ready(every):
            assert time.monotonic() < deadline, f"serve not ready: {self.errors()}"
            self.proc.send_signal(signal.SIGHUP)
            sent += 1
        return sent

    def errors(self) -> str:
        return child_output(self.stderr)

    def metric(self, sample: str) -> float | None:
        """`sample` in `/metrics` (with several workers: the one that answered)."""
        url = f"http://127.0.0.1:{self.admin_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(sample + " "):
                    return float(line.split()[-1])
        return None

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._selector.close()
        return int(self.proc.returncode)


def test_a_sighup_while_serve_starts_is_applied_once_it_is_up() -> None:
    """One process: its imports and start-up take about a second, during which SIGHUP's
    default action would end it; held, the reload runs once the handler is in place."""
    serve = Starting("--demo")
    try:
        serve.wait_held()
        serve.proc.send_signal(signal.SIGHUP)
        assert serve.ready(60.0), f"serve not ready: {serve.errors()}"
        deadline = time.monotonic() + 10
        while serve.metric(RELOADS) != 1.0:
            assert time.monotonic() < deadline, f"no reload: {serve.metric(RELOADS)}"
            time.sleep(0.05)
    finally:
        assert serve.stop() == 0, serve.errors()


def test_sighups_while_workers_start_and_start_again_cost_no_worker(redis_url: str) -> None:
    """A reload loop (SIGHUP every 0.2 s) while two workers start, then while one killed is
    started again: serve gets ready, the replacement comes up, nobody else dies."""
    serve = Starting("--demo", "--workers", "2", "--redis", redis_url)
    try:
        serve.wait_held()
        assert serve.ready_under_sighups(every=0.2) > 0
        line = next(line for line in serve.lines if "(pids [" in line)
        first = int(line.split("(pids [", 1)[1].split(",", 1)[0])
        os.kill(first, signal.SIGKILL)
        restarted = re.compile(r"started again \(pid (\d+)\)")
        deadline = time.monotonic() + 60
        while not restarted.search(serve.errors()):
            assert time.monotonic() < deadline, serve.errors()
            time.sleep(0.05)
        # SIGHUPs until a scrape reaches the replacement (each scrape is a new connection, which
        # the kernel hands to either worker), which then has its handler; a worker ended by
        # one would be started again, past the budget left dead.
        while serve.metric("quicedge_worker_starts") != 2.0:
            assert time.monotonic() < deadline, serve.errors()
            assert "(exit -1)" not in serve.errors() and "not started again" not in serve.errors()
            serve.proc.send_signal(signal.SIGHUP)
            time.sleep(0.2)
        log = serve.errors()
        assert len(restarted.findall(log)) == 1, log  # the SIGKILL's, no other
        os.kill(int(restarted.findall(log)[0]), 0)  # alive
    finally:
        assert serve.stop() == 0, serve.errors()


def test_the_exit_status_counts_a_worker_that_died_and_stayed_dead() -> None:
    assert exit_status([0, 0], []) == 0
    assert exit_status([0, -signal.SIGKILL], []) == 128 + signal.SIGKILL
    assert exit_status([-signal.SIGSEGV, 1], []) == 128 + signal.SIGSEGV
    assert exit_status([1, 0], [signal.SIGTERM]) == 1  # a worker that failed to start
    # Stopped by the SIGTERM the parent forwarded, before its handler was in place: as asked.
    assert exit_status([0, -signal.SIGTERM], [signal.SIGTERM]) == 0
    assert exit_status([-signal.SIGTERM, None], []) == 128 + signal.SIGTERM
