"""A mistake in one table of an array (`[[tenants]]`) names which one: the loader ran each
tenant's check without its place, so with many tenants `tenants.burst: needs
requests_per_second` left the operator to search for it."""

from __future__ import annotations

from pathlib import Path

import pytest

from edge.serve import build_parser, load_settings
from edge.settings import SettingsError

BACKEND = '[proxy]\nbackends = ["http://127.0.0.1:9"]\n'


@pytest.mark.parametrize(
    ("tenant", "message"),
    [
        ("burst = 3\n", "[[tenants]][1].burst: needs requests_per_second"),
        ("max_concurrent = 0\n", "[[tenants]][1].max_concurrent: must be >= 1"),
        ('api_key_sha256 = ["sk-plain"]\n', "[[tenants]][1].api_key_sha256: 64 lowercase hex"),
    ],
)
def test_a_tenants_mistake_names_its_place(tmp_path: Path, tenant: str, message: str) -> None:
    path = tmp_path / "quicedge.toml"
    path.write_text(BACKEND + '[[tenants]]\nname = "a"\n[[tenants]]\nname = "b"\n' + tenant)
    with pytest.raises(SettingsError) as info:
        load_settings(build_parser().parse_args(["--config", str(path)]), {})
    assert str(info.value).startswith(message), str(info.value)
