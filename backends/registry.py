"""The backends the edge forwards to, and what the edge knows about each of them.

Health has three independent parts:

- **Active checks**: `GET /health` every `interval`; `failure_threshold` consecutive failures
  mark a backend unhealthy, `success_threshold` consecutive successes mark it healthy again.
- **Passive ejection**: `eject_after` consecutive connect failures, timeouts, broken responses or
  5xx answers eject a backend for `eject_base_s`, doubling with each ejection in a row up to
  `eject_max_s` (exponential backoff, as Envoy's outlier detection). A success resets both.
- **Degraded**: a backend whose TTFT p99, KV usage (`token_usage` from `/v1/loads`) or waiting
  queue exceeds its threshold still takes work, but only when no healthy, non-degraded backend can.

`track()` is the one place where `in_flight` and `in_flight_prefill_tokens` change. Routing reads
them synchronously; they are exact because every change happens on one event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from backends.backend import Backend, InFlight, LoadView
from backends.labels import check_url, name_for, parse_labels
from backends.pool import UpstreamPool

log = logging.getLogger(__name__)

# Failure kinds `record_failure` accepts; the first four count towards passive ejection.
EJECTING_KINDS = frozenset({"connect", "timeout", "protocol", "upstream", "5xx"})
FAILURE_KINDS = EJECTING_KINDS | {"429", "4xx", "auth", "disconnect"}


class BackendClient(Protocol):
    """What the registry needs from `backends.sglang.SGLangClient`."""

    async def health(self) -> bool: ...
    async def loads(self) -> Any: ...
    async def aclose(self) -> None: ...


ClientFactory = Callable[[str, float], BackendClient]


def _sglang_client(url: str, timeout: float) -> BackendClient:
    from backends.sglang import SGLangClient

    return SGLangClient(url, timeout=timeout)


LOAD_POLLS_WARNED = 3
"""Failed `/v1/loads` polls in a row that are logged as a warning (one line per spell)."""


@dataclass(slots=True)
class HealthConfig:
    """Health checking, ejection and degradation settings (times in seconds)."""

    interval: float = 5.0
    """Period of the active `/health` check (SGLang's router: 60 s; we want faster return)."""
    timeout: float = 2.0
    """Timeout of one `/health` or `/v1/loads` call."""
    failure_threshold: int = 3
    success_threshold: int = 2
    loads_interval: float | None = 1.0
    """Period of `/v1/loads` polling; None turns it off."""
    eject_after: int = 5
    """Consecutive passive failures (connect, timeout, protocol, 5xx) that eject a backend."""
    eject_base_s: float = 2.0
    eject_max_s: float = 60.0
    degraded_ttft_p99_s: float | None = None
    """TTFT p99 above which a backend is degraded (None: not used)."""
    degraded_token_usage: float | None = 0.98
    """KV usage (0..1) above which a backend is degraded: its cache is evicting hard."""
    degraded_queue: int | None = None
    """Waiting requests (`num_waiting_reqs`) above which a backend is degraded."""
    ttft_window: int = 256
    """TTFT samples kept per backend for the p99."""
    min_ttft_samples: int = 20
    """Samples needed before the TTFT p99 may mark a backend degraded."""

    def __post_init__(self) -> None:
        positive = {
            "interval": self.interval,
            "timeout": self.timeout,
            "eject_base_s": self.eject_base_s,
            "eject_max_s": self.eject_max_s,
        }
        for name, value in positive.items():
            if not value > 0:
                raise ValueError(f"health.{name} must be > 0, got {value!r}")
        if self.loads_interval is not None and not self.loads_interval > 0:
            raise ValueError("health.loads_interval must be > 0 or None")
        for name in ("failure_threshold", "success_threshold", "eject_after", "ttft_window"):
            if getattr(self, name) < 1:
                raise ValueError(f"health.{name} must be >= 1")
        if self.degraded_token_usage is not None and not 0 < self.degraded_token_usage <= 1:
            raise ValueError("health.degraded_token_usage must be in (0, 1]")
        if self.degraded_ttft_p99_s is not None and not self.degraded_ttft_p99_s > 0:
            raise ValueError("health.degraded_ttft_p99_s must be > 0")
        if self.degraded_queue is not None and self.degraded_queue < 0:
            raise ValueError("health.degraded_queue must be >= 0")


class BackendRegistry:
    """Every backend, their health, and the edge's in-flight accounting."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        pool: UpstreamPool | None,
        health: HealthConfig | None = None,
        names: Sequence[str] | None = None,
        max_concurrency: int | None = None,
        warm_connections: int = 0,
        clock: Callable[[], float] = time.monotonic,
        client_factory: ClientFactory | None = None,
        allow_empty: bool = False,
    ) -> None:
        if not urls and not allow_empty:
            raise ValueError("at least one backend URL is required")
        if names is not None and len(names) != len(urls):
            raise ValueError("names must match urls one for one")
        if max_concurrency is not None and max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1")
        if warm_connections < 0:
            raise ValueError("warm_connections must be >= 0")
        self.health = health or HealthConfig()
        self.pool = pool
        self.warm_connections = warm_connections
        self._clock = clock
        self._client_factory = client_factory or _sglang_client
        self.max_concurrency = max_concurrency
        self.backends: list[Backend] = []
        """Every backend, draining ones included; changed in place by `add` and `remove`."""
        self._held: set[str] = set()
        """The names an operator drained (`hold`), kept while their backend is out of the
        fleet: one that discovery or a reload removes and brings back returns drained."""
        seen: set[tuple[str, int]] = set()
        for i, raw in enumerate(urls):
            backend = self._new_backend(raw, names[i] if names is not None else None)
            address = check_url(backend.url)[1]
            if address in seen:  # `http://h` and `http://H:80` are one backend
                raise ValueError(f"backend {backend.url} is listed twice")
            seen.add(address)
            self.backends.append(backend)
        self._by_name = {b.name: b for b in self.backends}
        if len(self._by_name) != len(self.backends):
            raise ValueError("backend names must be unique")
        self._tasks: list[asyncio.Task[None]] = []
        self._loops: dict[str, list[asyncio.Task[None]]] = {}
        self._clients: dict[str, BackendClient] = {}
        self._started = False
        self.on_healthy: list[Callable[[Backend], None]] = []
        """Called (synchronously) when a backend passes its checks again after failing them."""
        self.on_track: Callable[[], None] | None = None
        """Called (synchronously) as each request is counted in flight: the shared fleet view
        tells the other edge processes at once."""

    def _new_backend(self, raw: str, name: str | None) -> Backend:
        bare, labels = parse_labels(raw)
        url = check_url(bare)[0]
        backend = Backend(
            name=name if name is not None else name_for(url),
            url=url,
            max_concurrency=self.max_concurrency,
            labels=labels,
        )
        backend.ttfts = deque(maxlen=self.health.ttft_window)
        backend.held = backend.name in self._held
        return backend

    def get(self, name: str) -> Backend | None:
        return self._by_name.get(name)

    # -- operator drains ------------------------------------------------------------------
    def hold(self, name: str, held: bool) -> None:
        """Drain (`held`) or undrain the backend `name`, now and whenever it is in the fleet."""
        if held:
            self._held.add(name)
        else:
            self._held.discard(name)
        backend = self._by_name.get(name)
        if backend is not None:
            backend.held = held

    def hold_exactly(self, names: frozenset[str]) -> None:
        """Hold the backends `names` names, and no other (a shared drains hash's contents)."""
        self._held = set(names)
        for backend in self.backends:
            backend.held = backend.name in names

    @property
    def held(self) -> frozenset[str]:
        """The names held, in the fleet now or not."""
        return frozenset(self._held)

    # -- membership (discovery) -----------------------------------------------------------
    def add(self, url: str, *, name: str | None = None) -> Backend:
        """Add a backend at run time; once started, its checks and load polling start at once.

        Adding a URL the registry holds returns its backend (a draining one is taken back)."""
        bare, address = check_url(parse_labels(url)[0])
        backend = self._by_name.get(name if name is not None else name_for(bare))
        if backend is not None and backend.url == bare:
            backend.draining = False
            return backend
        backend = self._new_backend(url, name)
        if backend.name in self._by_name or any(
            check_url(b.url)[1] == address for b in self.backends
        ):
            raise ValueError(f"backend {backend.url} is already in the registry")
        self.backends.append(backend)
        self._by_name[backend.name] = backend
        log.info("backend %s added", backend.name)
        if self._started:
            self._start_backend(backend, warm=True)
        return backend

    async def remove(self, name: str, *, drain_timeout: float) -> None:
        """Take a backend out: no new requests at once, then wait (up to `drain_timeout` s) for
        those in flight on it to end, then stop its checks. Unknown names are ignored."""
        backend = self._by_name.get(name)
        if backend is None:
            return
        backend.draining = True
        log.info("backend %s draining (%d in flight)", name, backend.in_flight)
        deadline = time.monotonic() + drain_timeout
        # Polled: `track` is on every request's path, which should not pay for a notification.
        while backend.in_flight and backend.draining and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        if not backend.draining or self._by_name.get(name) is not backend:
            return  # added back, or removed by a concurrent call, meanwhile
        self.backends.remove(backend)
        del self._by_name[name]
        for task in self._loops.pop(name, []):
            task.cancel()
        client = self._clients.pop(backend.url, None)
        if client is not None:
            with contextlib.suppress(Exception):
                await client.aclose()
        if self.pool is not None:
            self.pool.forget(backend.url)
        log.info("backend %s removed (%d still in flight)", name, backend.in_flight)

    # -- selection ------------------------------------------------------------------------
    def available(self, backend: Backend, now: float | None = None) -> bool:
        """Healthy, not ejected and under its concurrency cap."""
        if now is None:
            now = self._clock()
        return (
            backend.healthy
            and not backend.draining
            and not backend.held
            and backend.ejected_until <= now
            and (backend.max_concurrency is None or backend.in_flight < backend.max_concurrency)
        )

    def candidates(self) -> list[Backend]:
        """Backends that may take a new request: degraded ones only if nothing else can."""
        now = self._clock()
        able = [b for b in self.backends if self.available(b, now)]
        for b in able:
            if b.warming_until > now:  # being warmed: only if no ready backend can take it
                able = [c for c in able if c.warming_until <= now] or able
                break
        good = [b for b in able if not b.degraded]
        return good or able

    # -- accounting -----------------------------------------------------------------------
    @contextlib.contextmanager
    def track(self, backend: Backend, *, prefill_tokens: int) -> Iterator[InFlight]:
        """Count one request in flight on `backend` for the duration of the block.

        The only place the in-flight counts change; the `finally` restores them on every path
        (success, error, client disconnect, timeout, cancellation).
        """
        tokens = max(0, int(prefill_tokens))
        in_flight = InFlight(backend, tokens)
        backend.in_flight += 1
        backend.in_prefill += 1
        backend.in_flight_prefill_tokens += tokens
        backend.requests += 1
        if self.on_track is not None:
            self.on_track()
        try:
            yield in_flight
        finally:
            in_flight.first_token()
            backend.in_flight -= 1

    def record_success(self, backend: Backend, *, ttft_s: float | None) -> None:
        backend.successes += 1
        backend.consecutive_failures = 0
        backend.ejections_in_a_row = 0
        if ttft_s is not None:
            backend.ttfts.append(ttft_s)
        self._update_degraded(backend)

    def record_failure(self, backend: Backend, kind: str) -> None:
        """Count a failed attempt; `kind` is one of FAILURE_KINDS (an UpstreamError's `.kind`)."""
        if kind not in FAILURE_KINDS:
            raise ValueError(
                f"unknown failure kind {kind!r}; expected one of {sorted(FAILURE_KINDS)}"
            )
        backend.failures[kind] = backend.failures.get(kind, 0) + 1
        if kind not in EJECTING_KINDS:
            return
        backend.consecutive_failures += 1
        if backend.consecutive_failures >= self.health.eject_after:
            h = self.health
            # (the doubling stops at 2**60: far past any cap, and short of a float's overflow)
            doubled = h.eject_base_s * 2 ** min(backend.ejections_in_a_row, 60)
            duration = min(h.eject_max_s, doubled)
            backend.ejected_until = self._clock() + duration
            backend.ejections_in_a_row += 1
            backend.consecutive_failures = 0
            log.warning(
                "ejecting backend %s for %.1fs after %s failures",
                backend.name,
                duration,
                h.eject_after,
            )

    def set_load(self, backend: Backend, load: Any) -> None:
        backend.load = load
        self._update_degraded(backend)

    def _update_degraded(self, backend: Backend) -> None:
        h = self.health
        reason = None
        load = backend.load
        if load is not None:
            if h.degraded_token_usage is not None and load.token_usage > h.degraded_token_usage:
                reason = f"token_usage {load.token_usage:.2f} > {h.degraded_token_usage}"
            elif h.degraded_queue is not None and load.num_waiting_reqs > h.degraded_queue:
                reason = f"queue {load.num_waiting_reqs} > {h.degraded_queue}"
        if reason is None and h.degraded_ttft_p99_s is not None:
            if len(backend.ttfts) >= h.min_ttft_samples:
                p99 = backend.ttft_p99()
                if p99 is not None and p99 > h.degraded_ttft_p99_s:
                    reason = f"ttft p99 {p99 * 1000:.0f}ms > {h.degraded_ttft_p99_s * 1000:.0f}ms"
        backend.degraded = reason is not None
        backend.degraded_reason = reason

    def record_check(self, backend: Backend, ok: bool, why: str = "") -> None:
        """Apply one active health-check result with the configured thresholds; `why` says
        what a failed one met, for the log line that marks the backend unhealthy."""
        if ok:
            backend.check_successes += 1
            backend.check_failures = 0
            if not backend.healthy and backend.check_successes >= self.health.success_threshold:
                backend.healthy = True
                log.info("backend %s is healthy again", backend.name)
                if self.pool is not None and self.warm_connections:
                    self._spawn(self.pool.warm(backend.url, self.warm_connections))
                for listener in self.on_healthy:
                    listener(backend)
        else:
            backend.check_failures += 1
            backend.check_successes = 0
            if backend.healthy and backend.check_failures >= self.health.failure_threshold:
                backend.healthy = False
                log.warning(
                    "backend %s failed %d health checks%s",
                    backend.name, backend.check_failures, f" (last: {why})" if why else "",
                )  # fmt: skip

    # -- background work ------------------------------------------------------------------
    def _spawn(self, coro: Any) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.append(task)
        task.add_done_callback(self._forget)
        return task

    def _forget(self, task: asyncio.Task[None]) -> None:
        with contextlib.suppress(ValueError):
            self._tasks.remove(task)

    def _client(self, backend: Backend) -> BackendClient:
        client = self._clients.get(backend.url)
        if client is None:
            client = self._clients[backend.url] = self._client_factory(
                backend.url, self.health.timeout
            )
        return client

    async def renew_clients(self) -> None:
        """Forget the health and load clients (each made with its backend's key then): the next
        check or poll makes a new one, with the key as it is now (a reload rotated the keys).
        A check in progress finishes on its old client, which is closed after it."""
        old, self._clients = list(self._clients.values()), {}
        for client in old:
            with contextlib.suppress(Exception):
                await client.aclose()

    async def check_once(self, backend: Backend) -> bool:
        """One active `/health` check; any error or timeout counts as a failure."""
        why = ""
        client = self._client(backend)
        try:
            async with asyncio.timeout(self.health.timeout):
                ok = bool(await client.health())
            if not ok:
                why = getattr(client, "health_error", None) or "it answered unhealthy"
        except TimeoutError:
            ok, why = False, f"no answer within {self.health.timeout:g}s"
        except Exception as exc:  # a dead backend raises many things; all mean "not healthy"
            log.debug("health check of %s failed: %r", backend.name, exc)
            ok, why = False, repr(exc)
        self.record_check(backend, ok, why)
        return ok

    async def poll_load_once(self, backend: Backend) -> None:
        """One `/v1/loads` poll. A failed one keeps the last load (see `Backend.load`), is
        counted, and is logged as a warning when it makes `LOAD_POLLS_WARNED` in a row."""
        try:
            async with asyncio.timeout(self.health.timeout):
                load = await self._client(backend).loads()
        except Exception as exc:
            backend.load_polls_failed += 1
            backend.load_polls_failing += 1
            if backend.load_polls_failing == LOAD_POLLS_WARNED:
                log.warning(
                    "load polls of %s failed %d times in a row (last: %r); routing on its last"
                    " known load until one answers",
                    backend.name, LOAD_POLLS_WARNED, exc,
                )  # fmt: skip
            else:
                log.debug("load poll of %s failed: %r", backend.name, exc)
            return
        if backend.load_polls_failing >= LOAD_POLLS_WARNED:
            log.info("load polls of %s answer again", backend.name)
        backend.load_polls_failing = 0
        self.set_load(backend, load)

    async def _check_loop(self, backend: Backend) -> None:
        while True:
            healthy = await self.check_once(backend)
            if healthy and backend.healthy and self.pool is not None and self.warm_connections:
                # Backends close idle keep-alive connections (uvicorn: after 5 s): top the
                # warm set up again so the next request does not pay a connect, but only while
                # it has traffic (an idle fleet would reconnect every few seconds for nothing).
                await self.pool.warm(backend.url, self.warm_connections, if_used=True)
            await asyncio.sleep(self.health.interval)

    async def _load_loop(self, backend: Backend, interval: float) -> None:
        while True:
            if backend.healthy:
                await self.poll_load_once(backend)
            await asyncio.sleep(interval)

    async def start(self) -> None:
        """Pre-warm pool connections, then start the health checks and load polling."""
        if self.pool is not None and self.warm_connections:
            await asyncio.gather(
                *(self.pool.warm(b.url, self.warm_connections) for b in self.backends)
            )
        for backend in self.backends:
            self._start_backend(backend, warm=False)
        self._started = True

    def _start_backend(self, backend: Backend, *, warm: bool) -> None:
        loops = self._loops.setdefault(backend.name, [])
        if warm and self.pool is not None and self.warm_connections:
            self._spawn(self.pool.warm(backend.url, self.warm_connections))
        loops.append(self._spawn(self._check_loop(backend)))
        if self.health.loads_interval is not None:
            loops.append(self._spawn(self._load_loop(backend, self.health.loads_interval)))

    async def aclose(self) -> None:
        tasks, self._tasks = list(self._tasks), []
        self._loops.clear()
        self._started = False
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            with contextlib.suppress(Exception):
                await client.aclose()

    # -- admin ----------------------------------------------------------------------------
    def snapshot(self) -> list[dict[str, Any]]:
        """JSON-able state of every backend, for the admin `/backends` route."""
        now = self._clock()
        out: list[dict[str, Any]] = []
        for b in self.backends:
            load = b.load
            p99 = b.ttft_p99()
            out.append(
                {
                    "name": b.name,
                    "url": b.url,
                    "labels": dict(b.labels),
                    "healthy": b.healthy,
                    "available": self.available(b, now),
                    "draining": b.draining,
                    "held": b.held,
                    "degraded": b.degraded,
                    "degraded_reason": b.degraded_reason,
                    "ready": b.warming_until <= now,
                    "ejected_for_s": round(max(0.0, b.ejected_until - now), 3),
                    "in_flight": b.in_flight,
                    "in_flight_prefill_tokens": b.in_flight_prefill_tokens,
                    "max_concurrency": b.max_concurrency,
                    "requests": b.requests,
                    "successes": b.successes,
                    "failures": dict(b.failures),
                    "ttft_p99_ms": None if p99 is None else round(p99 * 1000, 2),
                    "model": b.model,
                    "model_version": b.model_version,
                    "hw_group": b.hw_group,
                    "load": None
                    if load is None
                    else {
                        "num_running_reqs": load.num_running_reqs,
                        "num_waiting_reqs": load.num_waiting_reqs,
                        "num_total_tokens": load.num_total_tokens,
                        "token_usage": load.token_usage,
                        "max_total_tokens": load.max_total_tokens,
                    },
                    "load_polls_failing": b.load_polls_failing,
                }
            )
        return out


__all__ = [
    "EJECTING_KINDS",
    "FAILURE_KINDS",
    "Backend",
    "BackendClient",
    "BackendRegistry",
    "HealthConfig",
    "InFlight",
    "LoadView",
    "parse_labels",
]
