"""Compiled reverse proxies as yardsticks for `bench.edge_latency --spawn --reference NAME`.

What an edge adds at 32 streams depends on the machine as much as on the edge: on two cores,
the client and the stand-in share one, and every proxy pays the same system calls per token.
Measured in the same interleaved rounds, a Go proxy (Caddy) and a C one (nginx) in front of the
same stand-in show what this machine allows, so that the edge's figures can be read against
them. Each runs as one process on the edge's CPU (Caddy with `GOMAXPROCS=1`, nginx with one
worker and no master), configured the way a streaming reverse proxy should be: responses
flushed as they arrive, keep-alive upstream connections, TCP_NODELAY.

The binaries are not Python packages: Debian's `caddy` and `nginx-light` (or `nginx`) provide
them (`make bench-references` installs both).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

REFERENCES = ("caddy", "nginx")
INSTALL_HINT = "apt-get install caddy nginx-light (or: make bench-references)"


@dataclass
class Reference:
    """How to start one reference proxy."""

    name: str
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)


def caddy_config(port: int, backend: str) -> str:
    """A Caddyfile: plain HTTP on `port`, every response flushed as it arrives."""
    upstream = backend.removeprefix("http://")
    return f"""{{
\tadmin off
\tauto_https off
}}
http://127.0.0.1:{port} {{
\treverse_proxy {upstream} {{
\t\tflush_interval -1
\t}}
}}
"""


def nginx_config(port: int, backend: str, workdir: Path) -> str:
    """An nginx.conf: one process, keep-alive upstream, no buffering either way."""
    upstream = backend.removeprefix("http://")
    temp = "\n".join(
        f"    {kind}_temp_path {workdir / kind};"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    return f"""daemon off;
master_process off;
worker_processes 1;
pid {workdir / "nginx.pid"};
error_log {workdir / "nginx-error.log"} warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
{temp}
    upstream stand_in {{ server {upstream}; keepalive 64; }}
    server {{
        listen 127.0.0.1:{port};
        tcp_nodelay on;
        location / {{
            proxy_pass http://stand_in;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
        }}
    }}
}}
"""


def reference(name: str, port: int, backend: str, workdir: Path) -> Reference:
    """Write `name`'s configuration under `workdir` and say how to start it; a clear error when
    its binary is not installed."""
    binary = shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin")
    if binary is None:
        raise RuntimeError(f"--reference {name}: {name} is not installed ({INSTALL_HINT})")
    workdir.mkdir(parents=True, exist_ok=True)
    if name == "caddy":
        config = workdir / "Caddyfile"
        config.write_text(caddy_config(port, backend))
        return Reference(
            name,
            [binary, "run", "--config", str(config), "--adapter", "caddyfile"],
            # one OS thread running Go code, as the edge runs one event loop; its data and
            # config directories kept out of the user's home
            {"GOMAXPROCS": "1", "XDG_DATA_HOME": str(workdir), "XDG_CONFIG_HOME": str(workdir)},
        )
    if name == "nginx":
        config = workdir / "nginx.conf"
        config.write_text(nginx_config(port, backend, workdir))
        return Reference(name, [binary, "-c", str(config), "-e", str(workdir / "nginx.log")])
    raise ValueError(f"unknown reference proxy {name!r}; choose from {', '.join(REFERENCES)}")
