"""`SimServer`: the scheduler, the API and the HTTP listener, started and stopped together."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from types import TracebackType

from backends.kv_events import KvEventPublisher
from backends.sim.api import Api
from backends.sim.clock import Clock, LoopClock
from backends.sim.config import SimConfig
from backends.sim.http import HttpProtocol
from backends.sim.metrics import SimMetrics
from backends.sim.scheduler import Scheduler
from backends.sim.tokenizer import Tokenizer

log = logging.getLogger("backends.sim")


class SimServer:
    """A CPU stand-in for one SGLang server. `async with SimServer(cfg) as s: s.url`."""

    def __init__(self, config: SimConfig, *, clock: Clock | None = None) -> None:
        self.config = config
        self.clock = clock or LoopClock()
        self.tokenizer = Tokenizer()
        self.scheduler: Scheduler | None = None
        self.api: Api | None = None
        self._server: asyncio.Server | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._connections: set[HttpProtocol] = set()
        self._ready_at = 0.0
        self._publisher: KvEventPublisher | None = None
        self.port = 0

    @property
    def url(self) -> str:
        host = self.config.host
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    def _is_ready(self) -> bool:
        return self.clock.now() >= self._ready_at

    async def start(self) -> None:
        if self._server is not None:
            raise RuntimeError("SimServer already started")
        cfg = self.config
        events = cfg.kv_events
        if events is not None:
            self._publisher = KvEventPublisher(*events)
        scheduler = Scheduler(
            cfg, clock=self.clock, kv_events=self._publisher.publish if self._publisher else None
        )
        self.scheduler = scheduler
        api = Api(
            cfg,
            scheduler,
            tokenizer=self.tokenizer,
            metrics=SimMetrics(scheduler, cfg.model_name),
            is_ready=self._is_ready,
        )
        self.api = api
        self._ready_at = self.clock.now() + cfg.startup_delay * cfg.time_scale
        loop = asyncio.get_running_loop()
        self._loop_task = loop.create_task(scheduler.run(), name=f"sim-scheduler-{cfg.name}")
        self._loop_task.add_done_callback(_report_crash)
        self._server = await loop.create_server(
            lambda: HttpProtocol(
                api.handle,
                max_body_bytes=cfg.max_body_bytes,
                keep_alive=cfg.timeout_keep_alive,
                connections=self._connections,
            ),
            host=cfg.host,
            port=cfg.port,
            reuse_address=True,
            backlog=1024,
        )
        self.port = int(self._server.sockets[0].getsockname()[1])
        log.info("sim %s (%s) listening on %s", cfg.name, cfg.profile, self.url)

    async def stop(self) -> None:
        if self._server is None:
            return
        self._server.close()
        if self.scheduler is not None:
            self.scheduler.abort_all()
        for conn in list(self._connections):
            conn.close()
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        await self._server.wait_closed()
        self._server = None
        if self._publisher is not None:
            self._publisher.close()
            self._publisher = None

    async def __aenter__(self) -> SimServer:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()


def _report_crash(task: asyncio.Task[None]) -> None:
    """The scheduler loop only ends by cancellation; anything else is a bug worth a traceback."""
    if not task.cancelled() and task.exception() is not None:
        log.error("scheduler loop crashed", exc_info=task.exception())
