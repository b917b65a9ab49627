"""Two TCP listeners on one address: `quicedge serve` refuses it at start
(`TransportConfig.validate`), but a reload read the same file and took it as a change for the
next restart, which then did not start. The check is the `[serve]` section's own, so a reload
refuses it as a start does and the running settings stay."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from edge.reload import Reloader
from edge.serve import build_parser, load_settings
from edge.settings import SettingsError
from tests.edge.conftest import TinyUpstream, client, fast_config, run_edge
from tests.edge.state.helpers import ChatUpstream

CLASH = '[serve]\ntcp = "127.0.0.1:9443"\nadmin = "127.0.0.1:9443"\n'


def test_two_tcp_listeners_on_one_address_are_refused_at_load(tmp_path: Path) -> None:
    path = tmp_path / "quicedge.toml"
    path.write_text(CLASH)
    with pytest.raises(SettingsError, match="--admin 127.0.0.1:9443: the address of --tcp"):
        load_settings(build_parser().parse_args(["--demo", "--config", str(path)]), {})
    path.write_text('[serve]\ntcp = "0.0.0.0:9443"\nhttp = "127.0.0.1:9443"\ndev_certs = true\n')
    with pytest.raises(SettingsError, match="--http 127.0.0.1:9443: the address of --tcp"):
        load_settings(build_parser().parse_args(["--demo", "--config", str(path)]), {})
    path.write_text('[serve]\ntcp = "127.0.0.1:9443"\nadmin = "127.0.0.2:9443"\n')
    load_settings(build_parser().parse_args(["--demo", "--config", str(path)]), {})


async def test_a_reload_refuses_them_and_the_running_settings_serve_on(tmp_path: Path) -> None:
    path = tmp_path / "quicedge.toml"
    path.write_text("")
    async with (
        TinyUpstream(ChatUpstream()) as up,
        run_edge(fast_config([up.url])) as edge,
        client(edge) as http,
    ):

        def read() -> Any:
            args = build_parser().parse_args(["--config", str(path), "--backend", up.url])
            return load_settings(args, {})

        reloader = Reloader(read, read(), edge.wiring)
        path.write_text(CLASH)
        report = await reloader.reload_reported()
        assert report["outcome"] == "refused" and report["restart_pending"] == [], report
        assert report["error"] == (
            "--admin 127.0.0.1:9443: the address of --tcp; each TCP listener needs a port of its"
            " own"
        )
        body = {"model": "default", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}
        assert (await http.post("/v1/chat/completions", json=body)).status_code == 200
        await reloader.aclose()
