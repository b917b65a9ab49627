"""Admin actions that reach every worker of `quicedge serve --workers N`.

The admin listener is shared by the workers (SO_REUSEPORT), so a `POST /rollouts/{model}/
rollback` reaches one of them; each worker runs its own rollout from the same configuration, so
without this the action would move a 1/N share of the traffic. The worker that takes the action
hands it to every other worker over a private Unix socket of theirs (`worker-<i>.admin.sock`
beside the metrics sockets of `edge.fleet_metrics`), each running it in its own admin app, then
runs it itself. Its answer is its own, with `x-quicedge-workers: K/N`: how many workers (itself
included) answered below 400. A worker that does not answer within `PEER_TIMEOUT_S` is counted
out; the action is not retried.

Only the rollout and backend actions (`/backends/{name}/drain`, `/undrain`) and a config reload
(`/config/reload`) go to every worker:
`/prewarm` warms the backends, which one worker does for all, and every other admin route only
reads.

A rollback or a pause that a worker's own ramp decides (its share of the canary's errors, TTFT or
drift) is handed to the others the same way, so that one worker's evidence stops the canary
everywhere; each records it with the reason and the worker it came from. So is an advance (or
the promotion at the end), with the step it reached: a worker that is behind goes to that step
(`Ramp.follow`), so the workers ramp as one instead of each on its own share of the requests.
Each names the rollout's stable and canary version and the digest of its configured entry
(`entry_digest`), and a worker whose rollout of that pool has other versions or another entry
does not take it (it answers 409): a reload reaches the workers one by one, and while it does,
the old canary's advance or stop is no evidence about the new one, and an advance's step index
under the old steps means another share under the new. One without the digest is judged by its
versions.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
from typing import Any

import orjson

from edge.fleet_metrics import PEER_TIMEOUT_S, FleetPlan, close_server, listen_unix
from edge.models import Models
from edge.models.ramp import ADVANCES, STOPS, Transition
from edge.models.rollout import Rollout

log = logging.getLogger(__name__)

HEADER = b"x-quicedge-workers"
RELOAD = "/config/reload"
HANDED_OVER = STOPS | ADVANCES
"""A worker's own transitions that every other worker takes too."""
# Why a transition happens while this worker runs something every worker runs: `action`, an
# admin action each worker runs from its own state (a promote: each from its own step, so its
# advance is still handed on, and one behind follows one ahead); `handed`, another worker's
# transition taken here (never handed back).
_everywhere: contextvars.ContextVar[str | None] = contextvars.ContextVar("everywhere", default=None)


def _fanned(scope: Any) -> bool:
    return bool(
        scope["type"] == "http"
        and scope["method"] == "POST"
        and (scope["path"].startswith(("/rollouts/", "/backends/")) or scope["path"] == RELOAD)
    )


async def call(app: Any, method: str, path: str) -> tuple[int, bytes]:
    """Run one bodiless admin request through the ASGI `app`: (status, body)."""
    scope = {"type": "http", "method": method, "path": path, "query_string": b"",
             "headers": [], "asgi": {"version": "3.0"}}  # fmt: skip
    status, chunks = 500, []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = int(message["status"])
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope, receive, send)
    return status, b"".join(chunks)


class WorkerAdmin:
    """A worker's side: runs the actions other workers hand it; hands them its own."""

    def __init__(self, plan: FleetPlan, admin_app: Any, models: Models | None = None) -> None:
        self.plan = plan
        self.inner = admin_app
        self.models = models
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        if models is not None:
            models.on_transition.append(self._transitioned)

    def path(self, index: int) -> str:
        return os.path.join(self.plan.directory, f"worker-{index}.admin.sock")

    async def start(self) -> None:
        self._server = await listen_unix(self.path(self.plan.index), self._serve)

    async def aclose(self) -> None:
        await close_server(self._server)
        self._server = None
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(PEER_TIMEOUT_S):
                request = orjson.loads(await reader.readline())
                token = _everywhere.set("handed" if "rollout" in request else "action")
                try:
                    if "rollout" in request:
                        status = self._take(request)
                    else:
                        path = request["path"]
                        if not isinstance(path, str) or not _fanned({**request, "type": "http"}):
                            raise ValueError("not an action for every worker")
                        status, _ = await call(self.inner, "POST", path)
                finally:
                    _everywhere.reset(token)
            writer.write(orjson.dumps({"status": status}) + b"\n")
            await writer.drain()
        except (OSError, TimeoutError, ValueError, KeyError, TypeError):
            pass  # the asking worker counts this one out
        finally:
            writer.close()

    def _take(self, request: dict[str, Any]) -> int:
        """Another worker's own transition, taken here too."""
        ramp = self.models.ramps.get(request["rollout"]) if self.models is not None else None
        action = request["action"]
        if ramp is None or action not in HANDED_OVER:
            return 404
        versions = (request.get("stable"), request.get("canary"))
        if versions != (ramp.rollout.stable, ramp.rollout.canary):
            return 409  # another rollout of the pool (a reload not yet here, or not there)
        entry = request.get("entry")
        if entry is not None and entry != ramp.rollout.entry:
            return 409  # the same versions, other steps or limits: its step means another share
        reason = f"worker {int(request['worker'])}: {request['reason']}"
        ramp.take(action, int(request["step"]), reason)
        return 200

    def _transitioned(self, rollout: Rollout, transition: Transition) -> None:
        why = _everywhere.get()
        if transition.action not in HANDED_OVER or why == "handed":
            return
        if why == "action" and transition.action not in ADVANCES:
            return  # a stop every worker makes alike
        message = {"rollout": rollout.pool, "stable": rollout.stable, "canary": rollout.canary,
                   "entry": rollout.entry, "action": transition.action, "step": transition.step,
                   "reason": transition.reason, "worker": self.plan.index}  # fmt: skip
        task = asyncio.get_running_loop().create_task(self._hand_over(message))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _hand_over(self, message: dict[str, Any]) -> None:
        others = [i for i in range(self.plan.workers) if i != self.plan.index]
        answers = await asyncio.gather(*(self._ask(i, message) for i in others))
        if not all(answers):
            log.warning("rollout %s: %s reached %d of %d other workers", message["rollout"],
                        message["action"], sum(answers), len(others))  # fmt: skip

    async def _ask(self, index: int, message: dict[str, Any]) -> bool:
        try:
            async with asyncio.timeout(PEER_TIMEOUT_S):
                reader, writer = await asyncio.open_unix_connection(self.path(index))
                try:
                    writer.write(orjson.dumps(message) + b"\n")
                    await writer.drain()
                    answer = orjson.loads(await reader.readline())
                finally:
                    writer.close()
            return int(answer["status"]) < 400
        except (OSError, TimeoutError, ValueError, KeyError, TypeError):
            return False

    def wrap(self, admin_app: Any) -> Any:
        """The admin ASGI app whose rollout actions reach every worker."""

        async def app(scope: Any, receive: Any, send: Any) -> None:
            if not _fanned(scope):
                await admin_app(scope, receive, send)
                return
            others = [i for i in range(self.plan.workers) if i != self.plan.index]
            message = {"method": "POST", "path": scope["path"]}
            answers = await asyncio.gather(*(self._ask(i, message) for i in others))

            async def counted(message: dict[str, Any]) -> None:
                if message["type"] == "http.response.start":
                    done = sum(answers) + (message["status"] < 400)
                    tally = b"%d/%d" % (done, self.plan.workers)
                    message = {**message, "headers": [*message.get("headers", []), (HEADER, tally)]}
                await send(message)

            token = _everywhere.set("action")  # the others run it already
            try:
                await admin_app(scope, receive, counted)
            finally:
                _everywhere.reset(token)

        return app


__all__ = ["HEADER", "WorkerAdmin", "call"]
