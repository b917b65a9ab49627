"""A first wait above its longest is refused at load (as `[breakers]` refuses `open_for` above
`open_max`): `eject_base` or `backoff_s` above its maximum was accepted and silently cut to it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from edge.serve import build_parser, load_settings
from edge.settings import SettingsError

BACKEND = '[proxy]\nbackends = ["http://127.0.0.1:9"]\n'


def load(tmp_path: Path, text: str) -> Any:
    path = tmp_path / "quicedge.toml"
    path.write_text(BACKEND + text)
    return load_settings(build_parser().parse_args(["--config", str(path)]), {})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("eject_base = 60\neject_max = 30\n", "proxy.eject_max: must be >= eject_base"),
        (
            "[admission.redis]\nbackoff_s = 10\nbackoff_max_s = 5\n",
            "admission.redis.backoff_max_s: must be >= backoff_s",
        ),
    ],
)
def test_a_first_wait_above_its_longest_is_refused(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(SettingsError) as info:
        load(tmp_path, text)
    assert str(info.value).startswith(message), str(info.value)


def test_a_first_wait_equal_to_its_longest_loads(tmp_path: Path) -> None:
    load(tmp_path, "eject_base = 30\neject_max = 30\n[admission.redis]\nbackoff_s = 5\n")
