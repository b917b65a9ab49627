"""A SIGHUP that reaches `quicedge serve` as soon as its own code runs: a config-management tool
may send it right after it starts the edge, or to every process of a group. Held from the first
statements of the console script's module, it is applied once the edge is up, never the default
action that ends the process."""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from tests.helpers import child_output, free_port, free_udp_port

SCRIPT = Path(sys.executable).parent / "quicedge"
"""The console script `pip` writes: `from edge.cli import main` is the first thing it runs."""

RELOADS = 'quicedge_tls_reloads_total{outcome="applied"}'

# The console script, run as it is, in an interpreter that sends itself a SIGHUP at every
# module it imports from `edge.cli` on, but for its package and `signal` (which the hold needs): as
# early as the program's own code can act, and again at every step of the start-up after it.
LAUNCH = """
import os, runpy, signal, sys

sys.argv = sys.argv[1:]
started = False


def hook(event, args):
    global started
    if event != "import":
        return
    if started and args[0] not in ("edge", "signal"):
        os.kill(os.getpid(), signal.SIGHUP)
    elif args[0] == "edge.cli":
        started = True


sys.addaudithook(hook)
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _metric(port: int, sample: str) -> float | None:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(sample + " "):
                return float(line.split()[-1])
    return None


def test_sighups_from_the_console_scripts_first_import_on_never_end_serve() -> None:
    """They were held only once `main` ran, after `importlib.metadata` (tens of ms): one sent
    right after the start ended the edge (killed by SIGHUP). Held, they reload it once up."""
    admin = free_port()
    cmd = [
        sys.executable, "-c", LAUNCH, str(SCRIPT), "serve", "--demo",
        "--h3", f"127.0.0.1:{free_udp_port()}", "--tcp", f"127.0.0.1:{free_port()}",
        "--admin", f"127.0.0.1:{admin}",
    ]  # fmt: skip
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err)
        try:
            deadline = time.monotonic() + 60
            while "\nready\n" not in "\n" + child_output(out):
                code = proc.poll()
                assert code is None, f"serve ended ({code}): {child_output(err)}"
                assert time.monotonic() < deadline, f"serve not ready: {child_output(err)}"
                time.sleep(0.02)
            while _metric(admin, RELOADS) is None or _metric(admin, RELOADS) == 0:
                assert time.monotonic() < deadline, "the held SIGHUP was never applied"
                time.sleep(0.05)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        assert proc.returncode == 0, child_output(err)
