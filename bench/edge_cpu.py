"""CPU time the edge spends on a bench run, read from ``/proc`` when the edge runs on this machine.

The edge's processes are given (``--edge-pid``) or found: the processes holding a socket bound to
the target's port (``/proc/net/udp`` for HTTP/3, ``/proc/net/tcp`` for HTTP/2 and HTTP/1.1, and
their IPv6 twins) through the socket inodes in ``/proc/PID/fd``. Several workers sharing the port
(SO_REUSEPORT) are all found and summed. CPU is user + system time from ``/proc/PID/stat``, read
before and after the measured requests; divided by the requests, it is the edge's CPU per request.
Processes of another user cannot be read without privileges: then there is no figure, not a guess.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

_PROC = Path("/proc")
_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's `st` column
_LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1", "0.0.0.0", "::"})


def is_local(host: str) -> bool:
    return host in _LOCAL_HOSTS or host.startswith("127.")


def socket_inodes(port: int, kind: str, proc: Path = _PROC) -> set[int]:
    """Inodes of the sockets bound to local ``port``: UDP (``kind="udp"``) or listening TCP."""
    inodes: set[int] = set()
    for name in (kind, kind + "6"):
        try:
            lines = (proc / "net" / name).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10:
                continue
            local_port = int(fields[1].rsplit(":", 1)[1], 16)
            if local_port != port or (kind == "tcp" and fields[3] != _LISTEN):
                continue
            inode = int(fields[9])
            if inode:
                inodes.add(inode)
    return inodes


def pids_holding(inodes: set[int], proc: Path = _PROC) -> list[int]:
    """Processes with a file descriptor on one of these sockets (those this user may read)."""
    if not inodes:
        return []
    wanted = {f"socket:[{i}]" for i in inodes}
    found: list[int] = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fds = list((entry / "fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(fd) in wanted:
                    found.append(int(entry.name))
                    break
            except OSError:
                continue
    return sorted(found)


def find_edge(port: int, kinds: Iterable[str], proc: Path = _PROC) -> list[int]:
    """The processes serving ``port`` for these socket kinds (``udp``, ``tcp``)."""
    pids: set[int] = set()
    for kind in kinds:
        pids.update(pids_holding(socket_inodes(port, kind, proc), proc))
    return sorted(pids)


def cpu_seconds(pid: int, proc: Path = _PROC) -> float:
    """User + system CPU seconds of one process (fields 14 and 15 of ``/proc/PID/stat``)."""
    # The command name (field 2) may hold spaces and parentheses: split after its last ")".
    fields = (proc / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class EdgeCpu:
    """CPU of the edge's processes between `start` and `stop`."""

    pids: Sequence[int]
    _start: dict[int, float] | None = None
    seconds: float | None = None

    def start(self) -> None:
        self._start = {pid: cpu_seconds(pid) for pid in self.pids}

    def stop(self) -> float | None:
        """Seconds used since `start`; None when a process went away meanwhile."""
        assert self._start is not None, "not started"
        try:
            self.seconds = sum(cpu_seconds(pid) - t0 for pid, t0 in self._start.items())
        except OSError:
            self.seconds = None
        return self.seconds

    def report(self, requests: int) -> dict[str, object]:
        per = None if self.seconds is None or requests <= 0 else self.seconds / requests
        return {
            "pids": list(self.pids),
            "cpu_s": self.seconds,
            "requests": requests,
            "cpu_ms_per_request": None if per is None else per * 1e3,
            "clock_tick_s": 1 / os.sysconf("SC_CLK_TCK"),
        }


def describe(report: dict[str, object]) -> str:
    per = report["cpu_ms_per_request"]
    pids = ", ".join(str(p) for p in report["pids"])  # type: ignore[attr-defined]
    if per is None:
        return f"edge CPU: not measured (pid {pids} went away)"
    return (
        f"edge CPU: {per:.3f} ms per request ({report['cpu_s']:.2f} s user+sys over "
        f"{report['requests']} requests, pid {pids}; /proc ticks of {report['clock_tick_s']:g} s)"
    )
