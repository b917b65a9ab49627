"""``quicedge serve``: read the settings, make the app, run the listeners.

Settings come from flags, then ``QUICEDGE_*`` environment variables, then the TOML file
(``--config``), then the defaults (`edge.settings`; the sections are `edge.config.SECTIONS`).
The listeners, workers and signals are `transport.workers`; the proxy is `edge.wiring`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from prometheus_client import CollectorRegistry

from edge import settings, wiring
from edge.config import SECTIONS, ProxyConfig
from edge.routing.fleet_view import FleetViewConfig
from edge.routing.prewarm import PrewarmConfig
from edge.settings import Settings
from transport.config import EarlyDataSettings, TransportConfig
from transport.demo import DemoApps
from transport.early_data import EarlyDataPolicy
from transport.tls import TlsError, TlsMaterial, resolve_files
from transport.workers import AppFactory, Plan, ServedApps, serve


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
            "certificate."
        ),
    )
    parser.add_argument(
        "--config", metavar="FILE", help="TOML file with [serve], [early_data] and [proxy] tables"
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


def load_settings(args: argparse.Namespace, environ: Mapping[str, str]) -> Settings:
    """Every section, validated (the proxy's only when it is served: not with ``--demo``)."""
    loaded = settings.load(SECTIONS, toml=load_toml(args.config), environ=environ, flags=vars(args))
    return loaded.validate(skip=("proxy",) if args.demo else ())


def transport_config(loaded: Settings) -> TransportConfig:
    """``[serve]`` with the ``[early_data]`` policy in it."""
    early = loaded.get("early_data", EarlyDataSettings)
    return early.applied_to(loaded.get("serve", TransportConfig))


@dataclass
class ProxyApps:
    """`transport.workers.AppFactory` of the proxy: built and started inside each worker."""

    settings: Settings

    async def open(self, registry: CollectorRegistry) -> ServedApps:
        built = await wiring.build(
            self.settings.get("proxy", ProxyConfig),
            registry=registry,
            prewarm=self.settings.get("prewarm", PrewarmConfig),
            fleet_view=self.settings.get("fleet_view", FleetViewConfig),
            redis_url=self.settings.get("serve", TransportConfig).redis,
        )
        await built.start()
        return ServedApps(built.app, built.admin_app, built.aclose)

    def describe(self) -> str:
        proxy = self.settings.get("proxy", ProxyConfig)
        return f"proxy, policy {proxy.policy}, backends {' '.join(proxy.backends)}"


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("quic").setLevel(logging.WARNING)  # aioquic logs every connection at INFO
    try:
        loaded = load_settings(args, os.environ)
        transport = transport_config(loaded)
        # Fail early on bad TLS files; make the development certificates once, here, so
        # that workers never race to generate them.
        files = resolve_files(transport.cert, transport.key)
        TlsMaterial(files)
        transport = replace(transport, cert=str(files.cert), key=str(files.key))
    except (ValueError, TlsError) as exc:
        print(f"quicedge serve: {exc}", file=sys.stderr)
        return 2
    apps: AppFactory = DemoApps() if args.demo else ProxyApps(loaded)
    return serve(Plan(transport=transport, apps=apps))


__all__ = ["ProxyApps", "build_parser", "load_settings", "main", "transport_config"]
