"""The event loop choice: ``--loop`` / ``[serve] loop`` and ``transport.loop``."""

from __future__ import annotations

import asyncio

import pytest

from edge.serve import build_parser, load_settings, transport_config
from transport.config import TransportConfig
from transport.loop import loop_factory, resolve, run, running_loop_name, uvloop_available


def test_auto_prefers_uvloop_when_installed() -> None:
    assert resolve("auto") == ("uvloop" if uvloop_available() else "asyncio")
    assert resolve("asyncio") == "asyncio"
    assert loop_factory("asyncio") is asyncio.new_event_loop


def test_unknown_loop_is_refused() -> None:
    with pytest.raises(ValueError, match="loop must be one of auto, asyncio, uvloop"):
        resolve("trio")
    with pytest.raises(ValueError, match="loop must be one of"):
        TransportConfig(loop="trio").validate()


@pytest.mark.parametrize("name", ["asyncio", "uvloop"])
def test_run_uses_the_chosen_loop(name: str) -> None:
    if name == "uvloop":
        pytest.importorskip("uvloop")

    async def which() -> str:
        await asyncio.sleep(0)
        return running_loop_name()

    assert run(which(), name) == name


def test_flag_and_toml(tmp_path) -> None:
    config = tmp_path / "edge.toml"
    config.write_text('[serve]\nloop = "asyncio"\n')
    parser = build_parser()

    def loop(*argv: str) -> str:
        return transport_config(load_settings(parser.parse_args(["--demo", *argv]), {})).loop

    assert loop("--config", str(config)) == "asyncio"
    assert loop("--config", str(config), "--loop", "auto") == "auto"
    assert loop() == "auto"
