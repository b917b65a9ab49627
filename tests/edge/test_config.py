"""ProxyConfig and the wiring's flags: defaults, TOML, command line over TOML, clear errors."""

from __future__ import annotations

import argparse
import dataclasses
import math
import typing
from pathlib import Path
from typing import Any

import pytest

from edge.config import SECTIONS, ProxyConfig
from edge.policy.config import PolicyConfig
from edge.serve import load_toml
from edge.settings import environment_names
from edge.telemetry import cache_label
from edge.tracing import tracer_from_env
from edge.wiring import add_arguments, config_from


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_flags_override_toml() -> None:
    toml: dict[str, Any] = {
        "proxy": {"backends": ["http://127.0.0.1:1"], "policy": "least_load", "max_retries": 1}
    }
    config = config_from(parse("--policy", "cache_aware", "--chunk-timeout", "3"), toml)
    assert config.backends == ["http://127.0.0.1:1"]
    assert config.policy == "cache_aware"
    assert config.max_retries == 1
    assert config.chunk_timeout == 3.0
    assert config.first_byte_timeout == ProxyConfig().first_byte_timeout


def test_repeated_backend_flags_replace_toml_list() -> None:
    toml = {"proxy": {"backends": ["http://127.0.0.1:1"]}}
    config = config_from(
        parse("--backend", "http://127.0.0.1:2", "--backend", "http://127.0.0.1:3"), toml
    )
    assert config.backends == ["http://127.0.0.1:2", "http://127.0.0.1:3"]


def test_environment_between_flags_and_toml() -> None:
    toml = {"proxy": {"backends": ["http://127.0.0.1:1"], "max_retries": 1, "chunk_timeout": 9}}
    env = {"QUICEDGE_RETRIES": "3", "QUICEDGE_BACKEND": "http://a:1, http://b:2"}
    config = config_from(parse("--chunk-timeout", "4"), toml, env)
    assert config.backends == ["http://a:1", "http://b:2"]
    assert (config.max_retries, config.chunk_timeout) == (3, 4.0)
    assert config_from(parse("--retries", "0"), toml, env).max_retries == 0
    config = config_from(parse(), toml, {"QUICEDGE_DEGRADED_QUEUE": "none"})
    assert config.degraded_queue is None


def test_tracing_flag() -> None:
    assert config_from(parse("--backend", "http://a:1", "--tracing"), {}).tracing is True
    assert config_from(parse("--backend", "http://a:1"), {"proxy": {"tracing": True}}).tracing


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({}, "at least one backend"),
        ({"backends": ["ftp://x"]}, "http://HOST:PORT"),
        ({"backends": ["http://a:1", "http://a:1"]}, "twice"),
        ({"backends": ["http://a:1"], "nonsense": 1}, "unknown setting"),
        ({"backends": ["http://a:1"], "connect_timeout": "fast"}, "connect_timeout"),
        ({"backends": ["http://a:1"], "connect_timeout": 0}, "connect_timeout"),
        ({"backends": ["http://a:1"], "max_retries": -1}, "max_retries"),
        ({"backends": ["http://a:1"], "max_retries": 1.5}, "max_retries"),
        ({"backends": ["http://a:1"], "tracing": "yes"}, "tracing"),
        ({"backends": ["http://a:1"], "degraded_token_usage": 2}, "degraded_token_usage"),
        ({"backends": ["http://a:1"], "pool_warm_connections": 500}, "pool_warm"),
        ({"backends": "http://a:1"}, "proxy.backends: expected a list of strings"),
    ],
)
def test_bad_settings_are_named(section: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        config_from(parse(), {"proxy": section})


def _number_fields(kind: type) -> list[str]:
    hints = typing.get_type_hints(kind)
    return [
        f.name
        for f in dataclasses.fields(kind)
        if hints[f.name] is float or float in typing.get_args(hints[f.name])
    ]


PROXY_NUMBERS = _number_fields(ProxyConfig)
ENVIRONMENT = environment_names(SECTIONS)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("name", PROXY_NUMBERS)
def test_a_number_that_is_not_finite_is_refused_by_name(name: str, value: float) -> None:
    """TOML and `float()` take `nan` and `inf`; NaN passes every `<= 0` check, then breaks the
    timers (a 500 on every request), so each number setting refuses both."""
    assert {"connect_timeout", "chunk_timeout", "models_ttl", "drains_interval"} <= set(
        PROXY_NUMBERS
    )
    with pytest.raises(ValueError, match=rf"^proxy\.{name}: expected a finite number, got "):
        config_from(parse(), {"proxy": {"backends": ["http://a:1"], name: value}})
    variable = next(k for k, v in ENVIRONMENT.items() if v == f"proxy.{name}")
    with pytest.raises(ValueError, match=rf"^\${variable}: expected a finite number"):
        config_from(parse("--backend", "http://a:1"), {}, {variable: str(value)})
    with pytest.raises(ValueError, match=rf"^proxy: {name} must be a finite number, got "):
        ProxyConfig(backends=["http://a:1"], **{name: value}).validate()  # built in code


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        ({"wasm": [{"id": "m", "path": "m.wasm", "poll_interval": math.nan}]},
         "policy.wasm[0].poll_interval: expected a finite number, got nan"),
        ({"wasm": [{"id": "m", "path": "m.wasm", "poll_interval": math.inf}]},
         "policy.wasm[0].poll_interval: expected a finite number, got inf"),
        ({"judge": {"backends": ["http://g:1"], "timeout": math.nan}},
         "policy.judge.timeout: expected a finite number, got nan"),
        ({"judge": {"backends": ["http://g:1"], "timeout": math.inf}},
         "policy.judge.timeout: expected a finite number, got inf"),
        ({"judge": {"backends": ["http://g:1"], "timeout": 0}},
         "policy.judge.timeout: must be > 0, got 0.0"),
    ],
)  # fmt: skip
def test_a_policy_number_that_is_not_finite_is_refused_by_name(
    policy: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError) as refused:
        PolicyConfig.from_mapping(policy)
    assert str(refused.value) == message


def test_a_config_file_that_is_not_utf8_is_named(tmp_path: Path) -> None:
    """The codec's own error named neither the file nor the setting, at start and on a reload."""
    path = tmp_path / "quicedge.toml"
    path.write_bytes(b"[proxy]\nbackends = []\n# caf\xe9\n")  # Latin-1, not UTF-8
    with pytest.raises(ValueError) as refused:
        load_toml(str(path))
    assert str(refused.value) == f"--config {path}: not UTF-8 text (byte 0xe9 at offset 27)"


def test_proxy_section_must_be_a_table() -> None:
    with pytest.raises(ValueError, match=r"\[proxy\]"):
        config_from(parse(), {"proxy": 3})


def test_cache_labels() -> None:
    assert cache_label(100, None) == "unknown"
    assert cache_label(100, 0) == "miss"
    assert cache_label(100, 50) == "partial"
    assert cache_label(100, 95) == "hit"


def test_tracer_from_environment() -> None:
    assert tracer_from_env(environ={}).tracer is None
    assert tracer_from_env(environ={"OTEL_TRACES_EXPORTER": "none"}).tracer is None
    setup = tracer_from_env(environ={"OTEL_TRACES_EXPORTER": "console"})
    assert setup.tracer is not None
    setup.shutdown()
    forced = tracer_from_env(force=True, environ={})
    assert forced.tracer is not None
    forced.shutdown()
    with pytest.raises(ValueError, match="unknown exporter"):
        tracer_from_env(environ={"OTEL_TRACES_EXPORTER": "zipkin-ish"})
