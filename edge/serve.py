"""``quicedge serve``: read the settings, make the app, run the listeners.

Settings come from flags, then ``QUICEDGE_*`` environment variables, then the TOML file
(``--config``), then the defaults (`edge.settings`; the sections are `edge.config.SECTIONS`).
The listeners, workers and signals are `transport.workers`; the proxy is `edge.wiring`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import difflib
import logging
import os
import sys
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from prometheus_client import CollectorRegistry
from redis.connection import parse_url as redis_parse_url

from backends.discovery import DiscoveryConfig, make_source
from certs.dev import default_dir
from edge import settings, wiring
from edge.access_log import AccessLogConfig
from edge.admin import AdminApp, guard_actions
from edge.audit import AuditConfig, last_hash
from edge.config import SECTIONS, ProxyConfig
from edge.cors import CorsConfig
from edge.fleet_metrics import FleetMetrics, FleetPlan
from edge.models.config import ModelsConfig
from edge.policy.config import PolicyConfig
from edge.policy.wasm import WasmPolicy
from edge.reload import Reloader
from edge.routing.breakers import BreakerConfig
from edge.routing.fleet_view import FleetViewConfig
from edge.routing.kv_events import KvEventsConfig
from edge.routing.prewarm import PrewarmConfig
from edge.settings import Settings, SettingsError
from edge.tracing import exporter_names
from edge.worker_admin import WorkerAdmin
from transport.config import EarlyDataSettings, TransportConfig
from transport.demo import DemoApps
from transport.early_data import EarlyDataPolicy
from transport.tls import CertificateFiles, TlsError, TlsMaterial, resolve_files
from transport.workers import AppFactory, Plan, ServedApps, StartupError, serve


def build_parser() -> argparse.ArgumentParser:
    policy = EarlyDataPolicy()
    table = "\n".join(f"  {p:<22} {m.value}" for p, m in sorted(policy.routes.items()))
    parser = settings.parser(
        prog="quicedge serve",
        description="Run the edge proxy: HTTP/3 with 0-RTT, HTTP/2 and HTTP/1.1 over TLS. Every "
        "setting is also a TOML key of its table and a QUICEDGE_* environment variable "
        "(shown after each flag); flags win over the environment, which wins over TOML.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "early-data policy (requests received in 0-RTT, before the handshake completes):\n"
            f"{table}\n  {'(any other path)':<22} {policy.default.value}\n"
            "accept: served at once, forwarded with Early-Data: 1; defer: held until the "
            "handshake\ncompletes; reject: 425 Too Early. Change per route in the TOML "
            "[early_data] table\n(default = MODE, routes = {PATH = MODE}); --early-data "
            "overrides every route.\n\nSignals: SIGTERM/SIGINT drain, SIGHUP reloads the "
            'certificate and the config\nfile (docs/configuration.md, "Reloading the config").'
        ),
    )
    parser.add_argument(
        "--config", metavar="FILE", help="TOML file with [serve], [early_data] and [proxy] tables"
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="check the settings, the certificate and the policy modules, say what would be "
        "served, and exit without listening (status 0: usable, 2: the first problem found)",
    )
    parser.add_argument(
        "--demo",
        action="store_true",
        help="serve a built-in echo app instead of the proxy (no backends needed)",
    )
    settings.add_flags(parser, SECTIONS)
    return parser


def load_toml(path: str | None) -> dict[str, Any]:
    if path is None:
        return {}
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise ValueError(f"--config {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"--config {path}: {exc}") from None
    except UnicodeDecodeError as exc:  # TOML is UTF-8; the codec's own text names no file
        bad = exc.object[exc.start : exc.start + 1].hex()
        raise ValueError(
            f"--config {path}: not UTF-8 text (byte 0x{bad} at offset {exc.start})"
        ) from None


def load_settings(
    args: argparse.Namespace, environ: Mapping[str, str], toml: Mapping[str, Any] | None = None
) -> Settings:
    """Every section, validated (the proxy's only when it is served: not with ``--demo``).
    `toml` stands for the ``--config`` file's document where the caller already has it."""
    doc = load_toml(args.config) if toml is None else toml
    loaded = settings.load(SECTIONS, toml=doc, environ=environ, flags=vars(args))
    loaded.validate(skip=("proxy",))
    check_redis_urls(loaded)
    if not args.demo:
        discovery = loaded.get("discovery", DiscoveryConfig)
        try:
            # With discovery the `--backend` list may start empty: the first lookup fills it.
            proxy = loaded.get("proxy", ProxyConfig)
            proxy.validate(need_backends=discovery.mode == "static")
            proxy.with_features(loaded)
            make_source(discovery)  # fails here, not in a worker: outside a cluster, say
        except SettingsError:
            raise
        except ValueError as exc:
            raise SettingsError(str(exc)) from None
    return loaded


OTHER_VARIABLES = ("QUICEDGE_CERTS_DIR",)
"""`QUICEDGE_*` variables read elsewhere (`certs.dev`), not settings."""


def misspelt_variables(environ: Mapping[str, str]) -> list[str]:
    """A line for each `QUICEDGE_*` variable that names no setting but is close to one: the
    loader reads only the names it knows, so `QUICEDGE_WOKRERS=4` was ignored without a word.
    Not refused: the prefix is not the settings' alone (a test run's own variables)."""
    prefix = settings.ENV_PREFIX
    known = [
        n.removeprefix(prefix) for n in [*settings.environment_names(SECTIONS), *OTHER_VARIABLES]
    ]
    lines = []
    for name in sorted(environ):
        if not name.startswith(prefix) or name.removeprefix(prefix) in known:
            continue
        close = difflib.get_close_matches(name.removeprefix(prefix), known, n=1, cutoff=0.8)
        if close:
            lines.append(f"${name} is not a setting (did you mean ${prefix}{close[0]}?); ignored")
    return lines


def check_redis_urls(loaded: Settings) -> None:
    """Each Redis URL read as the client will read it: a bad port or option passed the
    sections' checks and then ended a worker with a traceback. The message leaves the URL out
    (it may carry a password)."""
    urls = [
        ("serve.redis", loaded.get("serve", TransportConfig).redis),
        ("fleet_view.redis", loaded.get("fleet_view", FleetViewConfig).redis),
    ]
    for name, url in urls:
        if url is None:
            continue
        try:
            redis_parse_url(url)
        except ValueError as exc:
            raise SettingsError(f"{name}: {exc}") from None


def transport_config(loaded: Settings) -> TransportConfig:
    """``[serve]`` with the ``[early_data]`` policy in it."""
    early = loaded.get("early_data", EarlyDataSettings)
    return early.applied_to(loaded.get("serve", TransportConfig))


@dataclass(frozen=True)
class SettingsSource:
    """How the running settings were read, to read them again on a reload: the same flags and
    `QUICEDGE_*` variables over the `--config` file as it is now."""

    args: argparse.Namespace
    environ: dict[str, str]

    @classmethod
    def of(cls, args: argparse.Namespace, environ: Mapping[str, str]) -> SettingsSource:
        own = {k: v for k, v in environ.items() if k.startswith(settings.ENV_PREFIX)}
        return cls(args, own)

    def load(self) -> Settings:
        return load_settings(self.args, self.environ)


@dataclass
class ProxyApps:
    """`transport.workers.AppFactory` of the proxy: built and started inside each worker."""

    settings: Settings
    fleet: FleetPlan | None = None
    """With several workers: where they serve their metrics to each other (edge.fleet_metrics)."""
    source: SettingsSource | None = None
    """Where a reload (SIGHUP, `config_poll_interval`) reads the settings again; None: a
    reload only compiles the policy modules again."""

    def for_worker(self, index: int) -> ProxyApps:
        if self.fleet is None:
            return self
        return replace(self, fleet=self.fleet.for_worker(index))

    async def open(self, registry: CollectorRegistry) -> ServedApps:
        discovery = self.settings.get("discovery", DiscoveryConfig)
        proxy = self.settings.get("proxy", ProxyConfig)
        built = await wiring.build(
            proxy,
            registry=registry,
            discovery=discovery,
            policies=self.settings.get("policy", PolicyConfig),
            audit=self.settings.get("audit", AuditConfig),
            breakers=self.settings.get("breakers", BreakerConfig),
            prewarm=self.settings.get("prewarm", PrewarmConfig),
            fleet_view=self.settings.get("fleet_view", FleetViewConfig),
            kv_events=self.settings.get("kv_events", KvEventsConfig),
            models=self.settings.get("models", ModelsConfig),
            redis_url=self.settings.get("serve", TransportConfig).redis,
            cors=self.settings.get("cors", CorsConfig),
            access_log=self.settings.get("access_log", AccessLogConfig),
        )
        try:
            await built.start()
        except (ValueError, OSError) as exc:  # an audit log it refuses, a file it cannot open
            await built.aclose()
            raise StartupError(str(exc)) from exc
        reload: Callable[[], None] = built.reload
        reloader = None
        if self.source is not None:
            reloader = Reloader(
                self.source.load, self.settings, built,
                path=self.source.args.config, poll_interval=proxy.config_poll_interval,
            )  # fmt: skip
            reloader.start()
            reload = reloader.reload
            if isinstance(built.admin_app, AdminApp):
                built.admin_app.reload_config = reloader.reload_reported
        admin_app = built.admin_app
        fleet = FleetMetrics(self.fleet, registry) if self.fleet is not None else None
        workers = None
        if self.fleet is not None:
            workers = WorkerAdmin(self.fleet, admin_app, models=built.models)
        if fleet is not None and workers is not None:
            admin_app = fleet.wrap(workers.wrap(admin_app))
            await fleet.start()
            await workers.start()
        admin_app = guard_actions(
            admin_app, proxy.admin_token(), built.audit, reads=proxy.admin_token_reads
        )

        async def aclose() -> None:
            if reloader is not None:
                await reloader.aclose()
            if workers is not None:
                await workers.aclose()
            if fleet is not None:
                await fleet.aclose()
            await built.aclose()

        record = built.audit.record_event if built.audit is not None else None
        return ServedApps(built.app, admin_app, aclose, reload=reload, record=record,
                          settle=built.settle)  # fmt: skip

    def describe(self) -> str:
        proxy = self.settings.get("proxy", ProxyConfig)
        text = f"proxy, routing {proxy.policy}, backends {' '.join(proxy.backends)}"
        gateway = self.settings.get("policy", PolicyConfig)
        counted = [(len(gateway.rules), "rule"), (len(gateway.wasm), "module"),
                   (len(gateway.stream_rules), "stream rule")]  # fmt: skip
        parts = [f"{n} {name}{'s' if n > 1 else ''}" for n, name in counted if n]
        if parts:  # what an operator checks first when a request is refused
            text += "; gateway " + ", ".join(parts)
        audit = self.settings.get("audit", AuditConfig)
        if audit.path:
            text += f"; audit log {audit.path}"
        return text


def check_modules(loaded: Settings) -> None:
    """Load each policy module once, as a worker will: compiled, then instantiated with the
    ABI's checks (no imports, the exports and their signatures, the memory limits). A missing,
    broken or unusable one stops `serve` (and `--check`) here with its id and path
    (ValueError), not in a worker nor on every request."""
    for module in loaded.get("policy", PolicyConfig).wasm:
        try:
            WasmPolicy(module)
        except Exception as exc:  # whatever the module's loading raises is the answer
            # wasmtime's errors run over several lines: the first says what is wrong
            first = (str(exc).splitlines() or [type(exc).__name__])[0]
            raise ValueError(f"policy.wasm {module.id!r} ({module.path}): {first}") from None


def check_audit_log(loaded: Settings) -> None:
    """The audit log each worker opens: its folder, and the end of the chain it continues
    (read only: a `--check` beside the running edge must not take the log's lock). A real
    start refused either only once it listened, in a line naming no setting (ValueError)."""
    path = loaded.get("audit", AuditConfig).path
    if not path:
        return
    folder = os.path.dirname(path) or "."
    if "{pid}" not in folder and not os.path.isdir(folder):
        raise ValueError(f"audit.path: {folder} is not a folder")
    if "{pid}" in path:
        return  # each worker's own file: none to continue before it starts
    try:
        last_hash(path)
    except ValueError as exc:
        text = str(exc)
        raise ValueError(text if text.startswith("audit.path") else f"audit.path: {text}") from None


def dev_files_or_given(transport: TransportConfig) -> CertificateFiles:
    """`--cert`/`--key`, or the development certificates, made here when they must be: a
    folder they cannot be made in is one line (TlsError), not a traceback."""
    try:
        return resolve_files(transport.cert, transport.key)
    except OSError as exc:
        where = f"{default_dir()}"
        if os.environ.get("QUICEDGE_CERTS_DIR"):
            where += " ($QUICEDGE_CERTS_DIR)"
        raise TlsError(
            f"no --cert/--key, and the development certificates cannot be made in {where}: "
            f"{exc.strerror}"
        ) from None


def check(args: argparse.Namespace, loaded: Settings, tls: TlsMaterial) -> int:
    """`serve --check`: print what would be served (the caller checked the settings, the
    certificate and the modules)."""
    lines = []
    if not args.demo:
        lines.append(f"app    {ProxyApps(loaded).describe()}")
        admission = loaded.get("proxy", ProxyConfig).admission
        anonymous = "on" if admission.anonymous.enabled else "off"
        lines.append(f"tenants {len(admission.tenants)}, anonymous {anonymous}")
    expires = dt.datetime.fromtimestamp(tls.expires_at, dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines.append(f"tls    {tls.files.cert}, expires {expires}")
    for line in lines:
        print(f"quicedge serve: {line}")
    print("quicedge serve: config OK (--check: nothing started)")
    return 0


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("quic").setLevel(logging.WARNING)  # aioquic logs every connection at INFO
    for line in misspelt_variables(os.environ):
        print(f"quicedge serve: {line}", file=sys.stderr)
    try:
        loaded = load_settings(args, os.environ)
        if not args.demo:  # an exporter that is not installed: one line now, not in a worker
            exporter_names(os.environ, force=loaded.get("proxy", ProxyConfig).tracing)
            check_modules(loaded)
            check_audit_log(loaded)
        transport = transport_config(loaded)  # (its listeners checked as it loaded)
        # Fail early on bad TLS files; make the development certificates once, here, so
        # that workers never race to generate them.
        files = dev_files_or_given(transport)
        tls = TlsMaterial(files)
        transport = replace(transport, cert=str(files.cert), key=str(files.key))
        if args.check:
            return check(args, loaded, tls)
    except (ValueError, TlsError) as exc:
        print(f"quicedge serve: {exc}", file=sys.stderr)
        return 2
    fleet = FleetPlan.create(transport.workers) if transport.workers > 1 else None
    apps: AppFactory = (
        DemoApps()
        if args.demo
        else ProxyApps(loaded, fleet=fleet, source=SettingsSource.of(args, os.environ))
    )
    try:
        return serve(Plan(transport=transport, apps=apps))
    finally:
        if fleet is not None:
            fleet.cleanup()


__all__ = [
    "ProxyApps",
    "SettingsSource",
    "build_parser",
    "load_settings",
    "main",
    "transport_config",
]
