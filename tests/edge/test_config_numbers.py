"""An integer too large for a float in a number setting: TOML's integers have no bound in
Python's reader, and `float()` of one raised OverflowError, which `quicedge serve` (and
`--check`) ended with a traceback and a reload refused without naming the setting."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from edge.reload import Reloader
from edge.serve import build_parser, load_settings
from edge.serve import main as serve_main
from edge.settings import SettingsError
from tests.edge.conftest import TinyUpstream, client, fast_config, run_edge
from tests.edge.state.helpers import ChatUpstream

BACKEND = '[proxy]\nbackends = ["http://127.0.0.1:9"]\n'
HUGE = "1" + "0" * 400


def load(tmp_path: Path, text: str) -> Any:
    path = tmp_path / "quicedge.toml"
    path.write_text(BACKEND + text)
    return load_settings(build_parser().parse_args(["--config", str(path)]), {})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (f"connect_timeout = {HUGE}\n", "proxy.connect_timeout: expected a finite number"),
        (f"[state]\nredis_timeout = {HUGE}\n", "state.redis_timeout: expected a finite number"),
        (f"[breakers]\nopen_for = {HUGE}\n", "breakers.open_for: expected a finite number"),
    ],
)
def test_a_huge_integer_is_refused_naming_the_setting(
    tmp_path: Path, text: str, message: str
) -> None:
    with pytest.raises(SettingsError) as info:
        load(tmp_path, text)
    assert str(info.value).startswith(message), str(info.value)


def test_a_large_integer_a_float_holds_still_loads(tmp_path: Path) -> None:
    settings = load(tmp_path, f"connect_timeout = {10**9}\n")
    assert settings["proxy"].connect_timeout == 1e9


def test_a_huge_integer_stops_serve_with_one_line_and_status_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "quicedge.toml"
    path.write_text(f"{BACKEND}chunk_timeout = {HUGE}\n")
    assert serve_main(["--check", "--config", str(path)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "proxy.chunk_timeout: expected a finite number" in err[0], err


async def test_a_reload_refuses_it_by_name_and_the_running_settings_serve_on(
    tmp_path: Path,
) -> None:
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
        path.write_text(f"[proxy]\nchunk_timeout = {HUGE}\n")
        report = await reloader.reload_reported()
        assert report["outcome"] == "refused", report
        assert report["error"].startswith("proxy.chunk_timeout: expected a finite number"), report
        body = {"model": "default", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}
        assert (await http.post("/v1/chat/completions", json=body)).status_code == 200
        assert edge.wiring.proxy is not None
        assert edge.wiring.proxy.attempts.config.chunk_timeout == 10.0  # fast_config's, kept
        await reloader.aclose()
