"""`[policy]` and `[audit]` in the TOML file reach the wiring; bad values are named."""

from __future__ import annotations

import argparse
import tomllib
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from edge.wiring import add_arguments, build, config_from

EXAMPLE = Path(__file__).parents[3] / "edge" / "policy" / "examples" / "deny_keyword.wasm"


def args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args([])


async def test_toml_tables_build_the_gateway_and_the_audit_log(tmp_path: Path) -> None:
    doc = tomllib.loads(f"""
[proxy]
backends = ["http://127.0.0.1:9"]

[policy]
stream_lookbehind = 64

[[policy.rules]]
id = "no-secrets"
patterns = ["password"]

[[policy.wasm]]
id = "kw"
path = "{EXAMPLE}"
on_error = "open"

[[policy.stream_rules]]
id = "leak"
patterns = ["BEGIN PRIVATE KEY"]
literal = true

[audit]
path = "{tmp_path / "audit.jsonl"}"
when_full = "refuse"
""")
    config = config_from(args(), doc)
    assert [r.id for r in config.gateway.rules] == ["no-secrets"]
    assert config.gateway.wasm[0].on_error == "open"
    assert config.audit.when_full == "refuse"
    wiring = await build(config, registry=CollectorRegistry())
    try:
        assert wiring.gateway is not None and len(wiring.gateway.modules) == 1
        assert wiring.gateway.stream is not None and wiring.gateway.stream.lookbehind == 64
        assert wiring.audit is not None
    finally:
        await wiring.aclose()


async def test_no_tables_build_nothing() -> None:
    config = config_from(args(), {"proxy": {"backends": ["http://127.0.0.1:9"]}})
    wiring = await build(config, registry=CollectorRegistry())
    try:
        assert wiring.gateway is None and wiring.audit is None
    finally:
        await wiring.aclose()


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"policy": {"rules": [{"id": "x", "patterns": ["("]}]}}, "policy.rules.patterns"),
        ({"policy": {"wasm": [{"id": "m"}]}}, "policy.wasm.path"),
        ({"audit": {"path": "a", "queue_size": 0}}, "audit.queue_size"),
        ({"proxy": {"gateway": {}}}, "unknown setting"),
    ],
)
def test_bad_tables_are_named(doc: dict[str, object], message: str) -> None:
    doc = {**doc, "proxy": {"backends": ["http://127.0.0.1:9"], **doc.get("proxy", {})}}  # type: ignore[dict-item]
    with pytest.raises(ValueError, match=message):
        config_from(args(), doc)
