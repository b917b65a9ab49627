"""`[serve]` `cert` and `key` are read when the settings are: a start refused files it could not
read, but a reload took them as a change for the next restart, which then did not start. The
check is the section's own, so a reload refuses them as a start does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from certs import ensure_dev_certificates
from edge.reload import Reloader
from edge.serve import build_parser, load_settings
from edge.settings import SettingsError
from tests.edge.conftest import TinyUpstream, client, fast_config, run_edge
from tests.edge.state.helpers import ChatUpstream


def files_toml(cert: Path | str, key: Path | str) -> str:
    return f'[serve]\ncert = "{cert}"\nkey = "{key}"\n'


def test_certificate_files_are_read_at_load(tmp_path: Path) -> None:
    dev = ensure_dev_certificates()
    path = tmp_path / "quicedge.toml"
    cases = [
        (files_toml(tmp_path / "c.pem", dev.key), f"cannot read certificate {tmp_path}/c.pem"),
        (files_toml(dev.cert, tmp_path / "k.pem"), f"cannot read key {tmp_path}/k.pem"),
        (files_toml(dev.key, dev.key), "certificate"),
    ]
    for text, message in cases:
        path.write_text(text)
        with pytest.raises(SettingsError, match=message):
            load_settings(build_parser().parse_args(["--demo", "--config", str(path)]), {})
    path.write_text(files_toml(dev.cert, dev.key))
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
        path.write_text(files_toml(tmp_path / "new.pem", tmp_path / "new.key"))
        report = await reloader.reload_reported()
        assert report["outcome"] == "refused" and report["restart_pending"] == [], report
        assert report["error"] == (
            f"cannot read certificate {tmp_path}/new.pem: No such file or directory"
        )
        body = {"model": "default", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}
        assert (await http.post("/v1/chat/completions", json=body)).status_code == 200
        await reloader.aclose()
