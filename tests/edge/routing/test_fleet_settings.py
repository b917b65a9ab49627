"""The `[prewarm]` and `[fleet_view]` sections through the one settings loader."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from edge import settings
from edge.config import SECTIONS
from edge.routing.fleet_view import FleetViewConfig
from edge.routing.prewarm import PrewarmConfig
from edge.settings import SettingsError


def load(toml: dict[str, Any], environ: dict[str, str] | None = None,
         argv: list[str] | None = None) -> settings.Settings:  # fmt: skip
    parser = argparse.ArgumentParser()
    settings.add_flags(parser, SECTIONS)
    flags = vars(parser.parse_args(argv or []))
    return settings.load(SECTIONS, toml=toml, environ=environ or {}, flags=flags).validate(
        skip=("proxy",)
    )


def test_both_are_off_by_default_and_read_from_toml_environment_and_flags() -> None:
    loaded = load({})
    assert loaded.get("prewarm", PrewarmConfig) == PrewarmConfig()
    assert not PrewarmConfig().enabled and not FleetViewConfig().enabled
    loaded = load(
        {"prewarm": {"enabled": True, "top": 4}, "fleet_view": {"interval": 0.5}},
        {"QUICEDGE_PREWARM_SHARE": "0.5", "QUICEDGE_FLEET_VIEW": "yes"},
        ["--prewarm-deadline", "3", "--fleet-view-redis", "redis://127.0.0.1:6379/0"],
    )
    prewarm = loaded.get("prewarm", PrewarmConfig)
    view = loaded.get("fleet_view", FleetViewConfig)
    assert (prewarm.enabled, prewarm.top, prewarm.share, prewarm.deadline) == (True, 4, 0.5, 3.0)
    assert (view.enabled, view.interval, view.redis) == (True, 0.5, "redis://127.0.0.1:6379/0")


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ({"prewarm": {"share": 0}}, "prewarm.share: must be in (0, 1]"),
        ({"prewarm": {"deadline": -1}}, "prewarm.deadline: must be > 0"),
        ({"prewarm": {"restart_check_interval": 0}}, "prewarm.restart_check_interval"),
        ({"prewarm": {"shard_token": 5}}, "did you mean 'shard_tokens'?"),
        ({"fleet_view": {"redis": "http://x"}}, "fleet_view.redis: expected a redis:// URL"),
        ({"fleet_view": {"interval": 0}}, "fleet_view.interval: must be > 0"),
    ],
)
def test_each_mistake_names_its_setting(toml: dict[str, Any], message: str) -> None:
    with pytest.raises((SettingsError, ValueError)) as caught:
        load(toml)
    assert message in str(caught.value)
