"""A SIGTERM that reaches `quicedge serve --workers N` while it starts a dead worker again: the
parent forwarded it to the workers it had, not to the one it was starting, and then waited
for that one forever, which served on."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

from tests.helpers import child_output, free_port, free_udp_port


def _children(pid: int) -> set[int]:
    """Process `pid`'s workers (not its other child, multiprocessing's resource tracker)."""
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) != pid:
                    continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if b"spawn_main" in f.read():
                    found.add(int(entry))
        except (OSError, IndexError, ValueError):
            continue  # ended meanwhile
    return found


def test_a_sigterm_while_a_worker_is_started_again_stops_that_worker_too(redis_url: str) -> None:
    """The spawn is slow on purpose: the settings a worker is sent (with the `QUICEDGE_*`
    variables the parent read, one of them long) exceed a pipe's buffer, so the parent's
    write waits until the new worker's interpreter reads them, and the SIGTERM, sent as soon
    as that worker exists, lands in the spawn. Before, the serve never ended."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("QUICEDGE_")}
    environ["QUICEDGE_TEST_PADDING"] = "x" * 100_000
    cmd = [
        sys.executable, "-m", "edge.cli", "serve", "--workers", "2", "--redis", redis_url,
        "--backend", f"http://127.0.0.1:{free_port()}", "--h3", f"127.0.0.1:{free_udp_port()}",
        "--tcp", f"127.0.0.1:{free_port()}", "--admin", f"127.0.0.1:{free_port()}",
    ]  # fmt: skip
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=environ)
        try:
            deadline = time.monotonic() + 60
            while (found := re.search(r"\(pids \[(\d+), (\d+)\]", child_output(out))) is None:
                assert proc.poll() is None, child_output(err)
                assert time.monotonic() < deadline, child_output(err)
                time.sleep(0.02)
            workers = {int(found.group(1)), int(found.group(2))}
            os.kill(int(found.group(1)), signal.SIGKILL)
            while not (_children(proc.pid) - workers):
                assert time.monotonic() < deadline, child_output(err)
                time.sleep(0.001)
            started = _children(proc.pid) - workers
            proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(30)
            except subprocess.TimeoutExpired:
                alive = [pid for pid in started if pid in _children(proc.pid)]
                raise AssertionError(f"serve still waits for its new worker {alive}") from None
        finally:
            if proc.poll() is None:
                for pid in _children(proc.pid):
                    os.kill(pid, signal.SIGKILL)
                proc.kill()
                proc.wait()
        assert code == 0, child_output(err)


def test_a_sigterm_while_the_workers_are_spawned_leaves_none_serving(redis_url: str) -> None:
    """The parent took over SIGTERM only once every worker was spawned: one in the spawn ended
    the parent alone, by its default action, and the workers spawned by then served on with
    nobody to stop them."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("QUICEDGE_")}
    environ["QUICEDGE_TEST_PADDING"] = "x" * 100_000  # a slow spawn, as above
    cmd = [
        sys.executable, "-m", "edge.cli", "serve", "--workers", "2", "--redis", redis_url,
        "--backend", f"http://127.0.0.1:{free_port()}", "--h3", f"127.0.0.1:{free_udp_port()}",
        "--tcp", f"127.0.0.1:{free_port()}", "--admin", f"127.0.0.1:{free_port()}",
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, env=environ, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        # The second worker in its spawn: the first has its settings, and would serve.
        while len(spawned := _children(proc.pid)) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, "no workers spawned"
            time.sleep(0.001)
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        while left := [pid for pid in spawned if os.path.exists(f"/proc/{pid}/cmdline")]:
            assert time.monotonic() < deadline, f"workers serving on: {left}"
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        with contextlib.suppress(ProcessLookupError):  # the workers, if left behind
            os.killpg(proc.pid, signal.SIGKILL)
