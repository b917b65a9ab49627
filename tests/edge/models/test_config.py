"""The `[models]` section read by the one settings loader, from TOML as docs/models.md shows."""

from __future__ import annotations

import tomllib

import pytest

from edge import settings
from edge.config import SECTIONS
from edge.models import ModelsConfig

DOC = """
[models]
default = "llama"

[[models.backends]]
url = "http://10.0.0.5:30000"
model = "llama"
version = "v1"
hardware_group = "h200"

[[models.aliases]]
name = "gpt-4o-mini"
model = "llama"

[[models.rollouts]]
model = "llama"
stable = "v1"
canary = "v2"
steps = [1, 5, 100]
shadow_fraction = 0.1

[models.rollouts.drift]
window = 100
"""


def load(doc: str) -> ModelsConfig:
    loaded = settings.load(SECTIONS, toml=tomllib.loads(doc), environ={}, flags={})
    loaded.validate(skip=("proxy",))
    return loaded.get("models", ModelsConfig)


def test_the_documented_table_loads() -> None:
    config = load(DOC)
    assert config.default == "llama" and config.discover
    (backend,) = config.backends
    assert (backend.model, backend.version, backend.hardware_group) == ("llama", "v1", "h200")
    assert config.aliases[0].name == "gpt-4o-mini"
    (rollout,) = config.rollouts
    assert rollout.steps == [1.0, 5.0, 100.0] and rollout.drift.window == 100
    assert load("").rollouts == []


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ('[[models.rollouts]]\nmodel = "m"\nstable = "a"\ncanary = "b"\nsteps = [5, 1]\n',
         "must rise"),
        ('[[models.rollouts]]\nmodel = "m"\nstable = "a"\ncanary = "a"\n', "must differ"),
        ('[[models.backends]]\nurl = "http://x:1"\nhardwre_group = "a"\n', "hardwre_group"),
        ('[[models.aliases]]\nname = "x"\n', "needs a name and a model"),
        ('[[models.rollouts]]\nmodel = "m"\nstable = "a"\ncanary = "b"\n'
         "[models.rollouts.drift]\nwindow = 5\n", ">= 30"),
    ],
)  # fmt: skip
def test_bad_values_are_refused_by_name(doc: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load(doc)


@pytest.mark.parametrize("value", ["none", "None", ""])
def test_a_header_of_none_turns_the_header_rule_off(value: str) -> None:
    loaded = load(DOC.replace("shadow_fraction = 0.1", f'header = "{value}"'))
    assert loaded.rollouts[0].header is None


def test_a_header_the_edge_does_not_read_is_refused() -> None:
    """The edge reads `x-canary` only: another name would be silently ignored (and `x-canary`
    would still choose), so it is refused when the config loads."""
    with pytest.raises(settings.SettingsError, match="x-canary"):
        load(DOC.replace("shadow_fraction = 0.1", 'header = "x-beta"'))
    assert load(DOC.replace("shadow_fraction = 0.1", 'header = "X-Canary"')).rollouts[0].header
