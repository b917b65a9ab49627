"""`scripts/run-local.sh` (what `make run` starts), run for real: its stand-in backends must be
its own, and whatever it started stops with it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from bench.children import free_port

ROOT = Path(__file__).parents[1]


def _gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_stand_in_that_cannot_listen_stops_the_script_before_the_edge() -> None:
    """A port held by another process (a stack still running, another server) made the
    stand-in on it exit at once; the script went on and started the edge in front of that
    other process, and printed its banner as if both stand-ins were up."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("QUICEDGE_")}
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        environ["SIM_PORTS"] = f"{taken} {free_port()}"
        child = subprocess.Popen(
            ["bash", "scripts/run-local.sh"], cwd=ROOT, env=environ, start_new_session=True,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            out, err = child.communicate(timeout=45)
        finally:
            if not _gone(child.pid):
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
    assert child.returncode != 0
    assert "quicedge local stack" not in out, out
    assert f"the stand-in backend on 127.0.0.1:{taken} did not start" in err, err
    assert _gone(child.pid)  # the other stand-in, which did start, was stopped too


def _children(pid: int) -> list[str]:
    """The command lines of process `pid`'s children."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            if parent != pid:
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                found.append(f.read().replace(b"\0", b" ").decode())
        except (OSError, IndexError, ValueError):
            continue  # ended meanwhile
    return found


def test_a_ctrl_c_while_the_certificates_are_made_stops_the_script() -> None:
    """The traps were set only after `quicedge certs`: a SIGINT that bash received while that
    child ran, and that the child did not die of (it had ended, or it was the script alone that
    was signalled), was taken as handled by the child, and the script went on to start the whole
    stack. A Ctrl-C as the certificates were checked was missed 3 times in 60."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("QUICEDGE_")}
    environ["SIM_PORTS"] = f"{free_port()} {free_port()}"
    child = subprocess.Popen(
        ["bash", "scripts/run-local.sh"], cwd=ROOT, env=environ, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not any(" certs" in line for line in _children(child.pid)):
            assert child.poll() is None and time.monotonic() < deadline, "no `quicedge certs`"
            time.sleep(0.002)
        os.kill(child.pid, signal.SIGINT)  # the script's own Ctrl-C, while it waits for certs
        while child.poll() is None:  # a stand-in started: the Ctrl-C was missed
            started = [line for line in _children(child.pid) if " sim " in line]
            assert not started and time.monotonic() < deadline, f"still running: {started}"
            time.sleep(0.01)
        out, err = child.communicate(timeout=30)
    finally:
        if not _gone(child.pid):
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
    assert child.returncode == 130, (child.returncode, out, err)
    assert "quicedge local stack" not in out, out
    assert _gone(child.pid)  # nothing it started is left


CTRL_C_BEFORE_THE_PID_IS_KEPT = """
set -T
hit=
trap 'if [[ -z $hit && $BASH_COMMAND == "pids+=("* ]]; then hit=1; kill -INT $$; fi' DEBUG
source scripts/run-local.sh
"""
"""The script, run as it is, with a Ctrl-C of its own the moment it has started the first
stand-in and is about to keep its pid (a debug trap runs before each command)."""


def test_a_ctrl_c_as_a_stand_in_is_started_stops_that_stand_in_too() -> None:
    """The trap ran between the `&` and the `pids+=($!)` after it: the cleanup left that
    stand-in running and then waited for it forever (4 runs in 40 with Ctrl-C at random)."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("QUICEDGE_")}
    environ["SIM_PORTS"] = f"{free_port()} {free_port()}"
    child = subprocess.Popen(
        ["bash", "-c", CTRL_C_BEFORE_THE_PID_IS_KEPT, "scripts/run-local.sh"], cwd=ROOT,
        env=environ, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        out, err = child.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        left = _children(child.pid)
        raise AssertionError(f"the script still waits for {left}") from None
    finally:
        if not _gone(child.pid):
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
    assert child.returncode == 130, (child.returncode, out, err)
    assert "quicedge local stack" not in out, out
