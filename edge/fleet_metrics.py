"""One `/metrics` for every worker of `quicedge serve --workers N`.

Each worker keeps its own `CollectorRegistry` with the lock-free metrics of `edge.light_metrics`
and the read-at-scrape `FleetCollector`, so a request pays exactly what it pays with one worker.
Besides, each worker answers on a private Unix socket (`<dir>/worker-<i>.sock`, a directory the
parent makes and removes) with its own exposition. The admin listener is shared by the workers
(SO_REUSEPORT), so any one of them may take a scrape: it reads the others' expositions over their
sockets, adds a `worker` label to every sample and serves the union. `sum without (worker)` gives
the process tree's totals; `/metrics?worker=self` is the plain view of the worker that answered.

Why not prometheus-client's multiprocess mode: it supports neither custom collectors (the
`FleetCollector` and the light metrics are custom) nor gauges that are read at scrape, and every
`inc()`/`observe()` writes an mmap'd file under a lock (`bench/fleet_metrics_cost.py` measures it
against the light metrics: the numbers are in docs/operations.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import parse_qs

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

WORKER_LABEL = "worker"
PEER_TIMEOUT_S = 2.0
"""How long a scrape waits for another worker's exposition before reporting it down."""


@dataclass(frozen=True, slots=True)
class FleetPlan:
    """Where the workers' sockets are, how many there are, and which one this process is.

    Picklable: it travels to spawned workers inside `edge.serve.Plan`."""

    directory: str
    workers: int
    index: int = 0

    @classmethod
    def create(cls, workers: int) -> FleetPlan:
        """A fresh private directory for `workers` sockets (the parent removes it: `cleanup`)."""
        return cls(tempfile.mkdtemp(prefix="quicedge-metrics-"), workers)

    def for_worker(self, index: int) -> FleetPlan:
        return replace(self, index=index)

    def socket_path(self, index: int) -> str:
        return os.path.join(self.directory, f"worker-{index}.sock")

    def cleanup(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


async def listen_unix(
    path: str, handler: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
) -> asyncio.AbstractServer:
    """A worker's private socket at `path`; one left there by a worker of the same index that
    died is replaced."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    return await asyncio.start_unix_server(handler, path=path)


async def close_server(server: asyncio.AbstractServer | None) -> None:
    if server is not None:
        server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.wait_closed(), 2)


class FleetMetrics:
    """A worker's side: serves its exposition on its socket, merges all workers' on `/metrics`."""

    def __init__(self, plan: FleetPlan, registry: CollectorRegistry) -> None:
        self.plan = plan
        self.registry = registry
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        self._server = await listen_unix(self.plan.socket_path(self.plan.index), self._serve_peer)

    async def aclose(self) -> None:
        await close_server(self._server)
        self._server = None

    async def _serve_peer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            writer.write(generate_latest(self.registry))
            await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def _peer(self, index: int) -> bytes | None:
        """Another worker's exposition, or None when it does not answer in time."""
        try:
            async with asyncio.timeout(PEER_TIMEOUT_S):
                reader, writer = await asyncio.open_unix_connection(self.plan.socket_path(index))
                try:
                    return await reader.read()
                finally:
                    writer.close()
        except (OSError, TimeoutError):
            return None

    async def exposition(self, *, self_only: bool = False) -> bytes:
        """This worker's exposition (`self_only`), or every worker's with a `worker` label."""
        own = generate_latest(self.registry)
        if self_only:
            return own
        others = [i for i in range(self.plan.workers) if i != self.plan.index]
        answers = await asyncio.gather(*(self._peer(i) for i in others))
        texts: dict[int, bytes | None] = dict(zip(others, answers, strict=True))
        texts[self.plan.index] = own
        # The merge is pure Python (~10 ms for 4 busy workers, bench.fleet_metrics_cost): off
        # the loop, so requests in flight keep their turns.
        return await asyncio.to_thread(merge_expositions, texts)

    def wrap(self, admin_app: Any) -> Any:
        """The admin ASGI app with `/metrics` answered by the whole fleet."""
        return _FleetAdmin(self, admin_app)


def merge_expositions(texts: dict[int, bytes | None]) -> bytes:
    """Text expositions by worker index → one exposition, each sample labelled with its worker.

    A worker whose text is None did not answer; `quicedge_metrics_worker_up` says which.
    Works on the text of `generate_latest` line by line, without parsing values: every family
    starts with its `# HELP` line, and a sample's name ends at its first `{` or space. (Parsing
    with prometheus-client's text parser and re-serialising took 476 ms for the 4 workers of
    `bench.fleet_metrics_cost`; this takes 15 ms.)"""
    headers: dict[bytes, list[bytes]] = {}
    samples: dict[bytes, list[bytes]] = {}
    up = [
        b"# HELP quicedge_metrics_worker_up 1 when the worker's metrics were read for this"
        b" scrape, 0 when it did not answer",
        b"# TYPE quicedge_metrics_worker_up gauge",
    ]
    for index in sorted(texts):
        text = texts[index]
        label = b'%s="%d"' % (WORKER_LABEL.encode(), index)
        up.append(b"quicedge_metrics_worker_up{%s} %d" % (label, text is not None))
        if text is None:
            continue
        family, fresh = b"", False
        for line in text.split(b"\n"):
            if not line:
                continue
            if line.startswith(b"#"):
                if line.startswith(b"# HELP "):
                    family = line.split(b" ", 3)[2]
                    if family not in headers:
                        headers[family] = []
                        samples[family] = []
                    fresh = not headers[family]
                if fresh:
                    headers[family].append(line)
                continue
            cut = _name_end(line)
            if line[cut : cut + 1] == b"{":
                line = b"%s{%s,%s" % (line[:cut], label, line[cut + 1 :])
            else:
                line = b"%s{%s}%s" % (line[:cut], label, line[cut:])
            samples[family].append(line)
    out: list[bytes] = []
    for family, lines in headers.items():
        out.extend(lines)
        out.extend(samples[family])
    out.extend(up)
    out.append(b"")
    return b"\n".join(out)


def _name_end(line: bytes) -> int:
    """Where a sample line's metric name ends: its first `{` or space."""
    brace, space = line.find(b"{"), line.find(b" ")
    if brace == -1:
        return space
    return brace if space == -1 or brace < space else space


class _FleetAdmin:
    """ASGI: `GET /metrics[?worker=self]` from the fleet, everything else from the admin app."""

    def __init__(self, fleet: FleetMetrics, inner: Any) -> None:
        self.fleet = fleet
        self.inner = inner

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if (
            scope["type"] != "http"
            or scope["path"] != "/metrics"
            or scope["method"] not in ("GET", "HEAD")
        ):
            await self.inner(scope, receive, send)
            return
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        body = await self.fleet.exposition(self_only=query.get(WORKER_LABEL) == ["self"])
        headers = [
            (b"content-type", CONTENT_TYPE_LATEST.encode()),
            (b"content-length", b"%d" % len(body)),
        ]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send(
            {"type": "http.response.body", "body": body if scope["method"] != "HEAD" else b""}
        )


__all__ = ["PEER_TIMEOUT_S", "WORKER_LABEL", "FleetMetrics", "FleetPlan", "merge_expositions"]
