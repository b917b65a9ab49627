"""Reloading the config file while serving (docs/configuration.md, "Reloading the config").

On SIGHUP, or when the `--config` file changes (with `config_poll_interval` set), the settings
are read again exactly as at start (the same flags and `QUICEDGE_*` variables over the file) and
validated. A file that does not load or validate changes nothing. Otherwise:

- `[[tenants]]` and `[admission.anonymous]` (API keys, tiers, quotas), `[admission.throttle]`
  (queue depths, the admission queue's size and timeout) and `[policy]` (rules,
  modules, stream rules, the guard model) apply to the requests that start from then on;
  requests in progress finish as they began. A new policy gateway is built (its modules
  compiled) in a thread, so the loop keeps serving meanwhile.
- `[cors]` while it stays on: origins, headers and lifetimes (`CorsApp.configure`); turning
  it on or off waits for a restart (the app is wrapped, or not, at start).
- `[access_log]`: on, off, or its sampling, for the requests that end next
  (`Wiring.set_access_log`).
- `[breakers]`: thresholds and windows for every domain's next decision; turned off, every
  domain closes (`Breakers.reconfigure`).
- `[models]` default, discover, aliases and rollouts (`Models.reconfigure`): a rollout whose
  entry changed starts again at its first step, an unchanged one keeps its state.
- `[proxy]` retries, retry budget and upstream timeouts (`max_retries`, `retry_budget`,
  `retry_budget_min`, `first_byte_timeout`, `chunk_timeout`), for the attempts that start next.
- `[proxy] backend_api_key_file` and `[proxy.backend_api_key_files]`: the key files are read
  again on every reload (a rotated Secret with the same paths included), and the keys apply to
  every upstream request, health check, load poll, model fetch and abort from then on
  (`Wiring.set_credentials`); requests in flight keep theirs. A key file that cannot be read,
  is empty or malformed refuses the reload, naming the setting and the file, never the key:
  the running keys stay. With `config_poll_interval` the key files are polled too.
- `[proxy] backends`: a new URL joins the registry at once, a removed one drains (no new
  requests, those in flight finish, up to `[discovery] drain_timeout`) and leaves, as backend
  discovery does it. A kept backend's labels (its isolation domain) wait for a restart.
- Any other section that differs from what the process started with is named in a warning and
  in `quicedge_config_restart_pending`: those shape listeners, pools and background tasks that
  are built once, and take effect on a restart (or a rolling update).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import fields
from typing import Any

from backends.credentials import BackendCredentials
from backends.discovery import DiscoveryConfig, wanted_urls
from edge.access_log import AccessLogConfig
from edge.admission.settings import AdmissionSettings
from edge.config import ProxyConfig
from edge.cors import CorsApp, CorsConfig
from edge.models import ModelsConfig
from edge.policy.config import PolicyConfig
from edge.policy.gateway import PolicyGateway
from edge.policy.wasm import WasmPolicy
from edge.routing.breakers import BreakerConfig
from edge.settings import Settings
from edge.wiring import Wiring, make_gateway
from transport.file_watch import FileWatch
from transport.loop import cancelled

log = logging.getLogger("quicedge.reload")

_LIVE_MODELS = ("default", "discover", "aliases", "rollouts")
"""The `[models]` fields a reload applies (`Models.reconfigure`)."""

_LIVE_PROXY = ("max_retries", "retry_budget", "retry_budget_min", "first_byte_timeout",
               "chunk_timeout")  # fmt: skip
"""The `[proxy]` fields a reload applies: how each request's attempts go (`Attempts`)."""

_KEY_FILES = ("backend_api_key_file", "backend_api_key_files")
"""The `[proxy]` fields naming the backends' key files: read again on every reload."""


def key_files(proxy: ProxyConfig) -> list[str]:
    """The backends' key files `proxy` names (the fleet's first)."""
    fleet = [proxy.backend_api_key_file] if proxy.backend_api_key_file else []
    return [*fleet, *proxy.backend_api_key_files.values()]


def read_keys(proxy: ProxyConfig) -> BackendCredentials:
    """The backends' keys as the files `proxy` names hold them now; ValueError naming the
    setting and the file (never the key) when one cannot be read, is empty or malformed."""
    return BackendCredentials.from_files(proxy.backend_api_key_file, proxy.backend_api_key_files)


LIVE = (
    "proxy.attempts",
    "proxy.backend_api_keys",
    "tenants",
    "admission.anonymous",
    "admission.throttle",
    "policy",
    "proxy.backends",
    "models",
    "breakers",
    "cors",
    "access_log",
)
"""What a reload applies while serving; every other difference waits for a restart."""

_CARRIED = {
    "proxy": ("admission", "state", "backends", *_LIVE_PROXY, *_KEY_FILES),
    "admission": ("anonymous", "tenants", "throttle"),
    "models": _LIVE_MODELS,
}
"""Fields a section carries that are compared on their own (`ProxyConfig.with_features` puts
the `[admission]` and `[state]` sections into `[proxy]`, and `[[tenants]]` into `[admission]`;
`[models]`' live fields apply, its others wait for a restart)."""


def _fields(value: Any, leave_out: tuple[str, ...]) -> Any:
    if not leave_out:
        return value
    return {f.name: getattr(value, f.name) for f in fields(value) if f.name not in leave_out}


def differences(old: Settings, new: Settings) -> tuple[list[str], list[str]]:
    """(the live parts that differ, the other sections that differ), by name."""
    live: list[str] = []
    if old["tenants"] != new["tenants"]:
        live.append("tenants")
    old_admission = old.get("admission", AdmissionSettings)
    new_admission = new.get("admission", AdmissionSettings)
    if old_admission.anonymous != new_admission.anonymous:
        live.append("admission.anonymous")
    if old_admission.throttle != new_admission.throttle:
        live.append("admission.throttle")
    if old["policy"] != new["policy"]:
        live.append("policy")
    if old["breakers"] != new["breakers"]:
        live.append("breakers")
    if old["access_log"] != new["access_log"]:
        live.append("access_log")
    old_cors, new_cors = old.get("cors", CorsConfig), new.get("cors", CorsConfig)
    cors_restart = old_cors != new_cors and not (old_cors.enabled and new_cors.enabled)
    if old_cors != new_cors and not cors_restart:
        live.append("cors")
    old_models, new_models = old.get("models", ModelsConfig), new.get("models", ModelsConfig)
    if any(getattr(old_models, f) != getattr(new_models, f) for f in _LIVE_MODELS):
        live.append("models")
    old_proxy, new_proxy = old.get("proxy", ProxyConfig), new.get("proxy", ProxyConfig)
    if any(getattr(old_proxy, f) != getattr(new_proxy, f) for f in _LIVE_PROXY):
        live.insert(0, "proxy.attempts")
    before = wanted_urls(old_proxy.backends)
    after = wanted_urls(new_proxy.backends)
    if before.keys() != after.keys():
        live.append("proxy.backends")
    restart = [
        name
        for name in old.names()
        if (name not in LIVE or name in _CARRIED)
        and _fields(old[name], _CARRIED.get(name, ())) != _fields(new[name], _CARRIED.get(name, ()))
    ]
    if cors_restart:  # on or off: the app is wrapped, or not, once at start
        restart.append("cors")
    relabelled = any(before[url] != after[url] for url in before.keys() & after.keys())
    if relabelled and "proxy" not in restart:  # a backend's domain is fixed while it serves
        restart.insert(0, "proxy")
    return live, restart


def _one_line(exc: BaseException) -> str:
    """An error's first line (wasmtime's run over several), or its type when it has no text."""
    return next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)


def _gateway(policies: PolicyConfig, **kwargs: Any) -> PolicyGateway | None:
    """`make_gateway`, whose failure names the setting as `serve` does at start: the raw error
    (`[Errno 2] ...`, wasmtime's text) says neither which module nor which table. Only when it
    failed is each module loaded alone, to find the one at fault."""
    try:
        return make_gateway(policies, **kwargs)
    except Exception as exc:
        for module in policies.wasm:
            try:
                WasmPolicy(module)
            except Exception as own:
                what = own.strerror if isinstance(own, OSError) and own.strerror else None
                raise ValueError(
                    f"policy.wasm {module.id!r} ({module.path}): {what or _one_line(own)}"
                ) from None
        raise ValueError(f"policy: {_one_line(exc)}") from None


def _report(
    outcome: str,
    *,
    changed: list[str] | None = None,
    restart_pending: list[str] | None = None,
    error: str | None = None,
) -> dict[str, Any]:
    return {"outcome": outcome, "changed": changed or [],
            "restart_pending": restart_pending or [], "error": error}  # fmt: skip


class Reloader:
    """Reads the settings again and applies what can change live to one worker's `Wiring`."""

    def __init__(
        self,
        load: Callable[[], Settings],
        running: Settings,
        wiring: Wiring,
        *,
        path: str | None = None,
        poll_interval: float | None = None,
    ) -> None:
        self._load = load
        self._started = running
        """What the process started with: the sections a reload cannot change stay these."""
        self._applied = running
        """The live sections as last applied."""
        self.wiring = wiring
        self._task: asyncio.Task[None] | None = None
        self._again = False
        self._again_signal = False
        self._watch = (
            FileWatch([path], poll_interval, lambda: self._schedule(signal=False))
            if path is not None and poll_interval is not None
            else None
        )
        # The key files too, on their own (one missing for a moment must not hide a change of
        # the config file): a rotated Secret (its `..data` symlink swapped) is read at once.
        self._key_watch = (
            FileWatch(
                key_files(running.get("proxy", ProxyConfig)),
                poll_interval,
                lambda: self._schedule(signal=False),
            )
            if path is not None and poll_interval is not None
            else None
        )
        self._lock = asyncio.Lock()
        self._queued: asyncio.Task[dict[str, Any]] | None = None
        """The reload waiting for the one that runs (`reload_reported`)."""
        self.reloads = wiring.metrics.config_reloads
        self.restart_pending = wiring.metrics.config_restart_pending

    def start(self) -> None:
        for watch in (self._watch, self._key_watch):
            if watch is not None:
                watch.start()

    def reload(self) -> None:
        """SIGHUP: reload soon, policy modules included."""
        self._schedule(signal=True)

    def _schedule(self, *, signal: bool) -> None:
        """One reload at a time; a request during one runs another after it."""
        self._again_signal |= signal
        if self._task is not None and not self._task.done():
            self._again = True
            return
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        self._again = True
        while self._again:
            signal, self._again, self._again_signal = self._again_signal, False, False
            await self.reload_now(signal=signal)

    async def reload_now(self, *, signal: bool = False) -> str:
        """Read the settings again and apply them; the outcome counted. `signal`: also compile
        unchanged policy modules again (SIGHUP's meaning for them)."""
        return str((await self.reload_reported(signal=signal))["outcome"])

    async def reload_reported(self, *, signal: bool = True) -> dict[str, Any]:
        """`reload_now`, and what it did: the outcome, the live parts it changed, the sections
        that wait for a restart, and the error of a refused one (the admin listener's `POST
        /config/reload`). One runs at a time; a call while one runs queues the next, and calls
        while that one waits share it, so a flood of calls costs two reloads, not one each."""
        queued = self._queued
        if queued is None or queued.done():
            queued = self._queued = asyncio.get_running_loop().create_task(self._in_turn(signal))
        return await asyncio.shield(queued)

    async def _in_turn(self, signal: bool) -> dict[str, Any]:
        async with self._lock:
            self._queued = None  # running now: a later call queues another, which reads later
            return await self._reload(signal=signal)

    async def _reload(self, *, signal: bool) -> dict[str, Any]:
        for watch in (self._watch, self._key_watch):
            if watch is not None:
                watch.seen()
        try:
            new = await asyncio.to_thread(self._load)
            # Read on every reload, the paths changed or not: rotating a Secret changes the files.
            keys = await asyncio.to_thread(read_keys, new.get("proxy", ProxyConfig))
            live, restart = differences(self._applied, new)
            _, pending = differences(self._started, new)
            gateway = None
            if "policy" in live:
                gateway = await asyncio.to_thread(
                    _gateway,
                    new.get("policy", PolicyConfig),
                    metrics=self.wiring.metrics,
                    pool=self.wiring.pool,
                )
        except Exception as exc:  # a file that does not load keeps the running settings
            error = _one_line(exc)
            self.reloads.labels("refused").inc()
            self.wiring.metrics.config_reload_ok.set(0)
            log.error("config reload refused, the running settings stay: %s", error)
            self._audit("refused", error=error)
            return _report("refused", error=error)
        if self._key_watch is not None:  # the files the settings name now
            self._key_watch.paths = key_files(new.get("proxy", ProxyConfig))
            self._key_watch.seen()
        try:
            if await self.wiring.set_credentials(keys):
                live.insert(0, "proxy.backend_api_keys")
            await self._apply(new, live, gateway, signal=signal)
        except Exception as exc:  # a bug here must not end the reloads for the process's life
            self.reloads.labels("refused").inc()
            self.wiring.metrics.config_reload_ok.set(0)
            log.exception("config reload failed while applying %s", ", ".join(live))
            self._audit("refused", error=f"while applying: {_one_line(exc)}")
            return _report("refused", error=f"while applying: {_one_line(exc)}")
        self._applied = new
        self.wiring.metrics.config_reload_ok.set(1)
        self.restart_pending.set(1 if pending else 0)
        if pending and restart:
            log.warning(
                "config reload: %s changed; that takes effect on a restart",
                ", ".join(f"[{name}]" for name in pending),
            )
        outcome = "applied" if live else "unchanged"
        self.reloads.labels(outcome).inc()
        self._audit(outcome, changed=live, restart_pending=pending)
        log.info("config reload %s%s", outcome, f": {', '.join(live)}" if live else "")
        return _report(outcome, changed=live, restart_pending=pending)

    async def _apply(
        self, new: Settings, live: list[str], gateway: PolicyGateway | None, *, signal: bool
    ) -> None:
        if "proxy.attempts" in live:
            proxy = new.get("proxy", ProxyConfig)
            self.wiring.set_attempts({f: getattr(proxy, f) for f in _LIVE_PROXY})
        if "tenants" in live or "admission.anonymous" in live:
            self.wiring.admission.set_tenants(new.get("proxy", ProxyConfig).admission)
        if "admission.throttle" in live:
            self.wiring.admission.set_throttle(new.get("admission", AdmissionSettings).throttle)
        if "proxy.backends" in live:
            drain = new.get("discovery", DiscoveryConfig).drain_timeout
            await self.wiring.set_backends(new.get("proxy", ProxyConfig).backends, drain)
        if "access_log" in live:
            await self.wiring.set_access_log(new.get("access_log", AccessLogConfig))
        if "cors" in live and isinstance(self.wiring.app, CorsApp):
            self.wiring.app.configure(new.get("cors", CorsConfig))
        if "breakers" in live and self.wiring.breakers is not None:
            await self.wiring.breakers.reconfigure(new.get("breakers", BreakerConfig))
        if "models" in live:
            changed = await self.wiring.models.reconfigure(new.get("models", ModelsConfig))
            log.warning("config reload: [models]: %s", ", ".join(changed) or "no change")
        if "policy" in live:
            await self.wiring.swap_gateway(gateway)
        elif signal:
            self.wiring.reload()

    def _audit(self, outcome: str, **fields: Any) -> None:
        """The reload in the audit log's chain (`event: config_reload`), when it is on."""
        if self.wiring.audit is not None:
            self.wiring.audit.record_event("config_reload", outcome=outcome, **fields)

    async def aclose(self) -> None:
        for watch in (self._watch, self._key_watch):
            if watch is not None:
                await watch.aclose()
        await cancelled(self._task)
        await cancelled(self._queued)
        self._task = self._queued = None


__all__ = ["LIVE", "Reloader", "differences"]
