"""The Redis URLs of `[state]` and `[admission.redis]` are read at load as the client reads
them: a bad port passed every check (`serve --check` said OK) and then ended each worker at its
start with a traceback."""

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
        (
            '[state]\nstore = "redis"\nredis_url = "redis://127.0.0.1:notaport/0"\n',
            "state.redis_url: Port could not be cast",
        ),
        ('[admission.redis]\nurl = "redis://127.0.0.1:99999/0"\n', "admission.redis.url: Port"),
    ],
)
def test_a_redis_url_the_client_cannot_read_is_refused_at_load(
    tmp_path: Path, text: str, message: str
) -> None:
    with pytest.raises(SettingsError) as info:
        load(tmp_path, text)
    assert str(info.value).startswith(message), str(info.value)


@pytest.mark.parametrize(
    "text",
    [
        '[state]\nstore = "redis"\nredis_url = "redis://:pw@127.0.0.1:6379/0"\n',
        '[admission.redis]\nurl = "unix:///run/redis.sock"\n',
        '[admission.redis]\nurl = "rediss://127.0.0.1:6380/1"\n',
    ],
)
def test_a_good_redis_url_loads(tmp_path: Path, text: str) -> None:
    load(tmp_path, text)
