"""Metrics in the ecosystem's conventions: a bounded `model` label on TTFT and request counts,
counters typed as counters, one spelling of `backend`; and an exporter that is not installed is
one line from `quicedge serve`, not a traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from prometheus_client.parser import text_string_to_metric_families

from backends.sim import SimConfig, SimServer
from edge.tracing import exporter_names, tracer_from_env
from tests.edge.conftest import client, fast_config, run_edge
from tests.edge.test_app_sim import metrics_text
from tests.helpers import wait_until

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}


async def test_ttft_and_requests_carry_a_bounded_model_label() -> None:
    config = SimConfig(name="m", port=0, profile="instant", served_model_name="llama-8b")
    async with SimServer(config) as sim:
        async with run_edge(fast_config([sim.url])) as edge, client(edge) as http:
            for model in ("llama-8b", "default", None):
                body = CHAT if model is None else {**CHAT, "model": model}
                assert (await http.post("/v1/chat/completions", json=body)).status_code == 200
            for i in range(3):  # models nobody serves: one label between them
                r = await http.post("/v1/chat/completions", json={**CHAT, "model": f"x{i}"})
                assert r.status_code == 404
            assert (await http.get("/nowhere")).status_code == 404
            text = await metrics_text(edge)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    requests = {
        (s.labels["route"], s.labels["status"], s.labels["model"]): s.value
        for s in families["quicedge_requests"].samples
    }
    assert requests[("/v1/chat/completions", "200", "llama-8b")] == 1
    assert requests[("/v1/chat/completions", "200", "default")] == 2  # named, and unnamed
    assert requests[("/v1/chat/completions", "404", "other")] == 3
    assert requests[("other", "404", "none")] == 1
    ttft = {
        s.labels["model"]: s.value
        for s in families["quicedge_ttft_seconds"].samples
        if s.name.endswith("_count")
    }
    assert ttft == {"llama-8b": 1, "default": 2}


async def test_counters_are_counters_and_backend_is_the_backends_name() -> None:
    async with SimServer(SimConfig(name="c", port=0, profile="instant")) as sim:
        async with run_edge(fast_config([sim.url])) as edge, client(edge) as http:
            assert (await http.post("/v1/chat/completions", json=CHAT)).status_code == 200
            text = await metrics_text(edge)
            name = edge.wiring.registry.backends[0].name
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["quicedge_upstream_connects"].type == "counter"
    assert families["quicedge_upstream_connects"].samples[0].value >= 1
    backends = {
        s.labels["backend"]
        for f in families.values()
        for s in f.samples
        if "backend" in s.labels and f.name.startswith("quicedge_")
    }
    assert backends == {name}


async def test_a_removed_backends_idle_connections_keep_its_name_as_their_label() -> None:
    """A backend removed (a reload, discovery) may leave connections in the pool a while (those
    in flight close when their request ends): any still counted are labelled with its name
    (`host:port`), not with its URL."""
    async with (
        SimServer(SimConfig(name="a", port=0, profile="instant")) as kept,
        SimServer(SimConfig(name="b", port=0, profile="instant")) as gone,
    ):
        config = fast_config([kept.url, gone.url], policy="round_robin")
        async with run_edge(config) as edge, client(edge) as http:
            for _ in range(4):
                assert (await http.post("/v1/chat/completions", json=CHAT)).status_code == 200
            names = {b.url: b.name for b in edge.wiring.registry.backends}
            await edge.wiring.set_backends([kept.url], drain_timeout=0.0)
            await wait_until(lambda: len(edge.wiring.registry.backends) == 1)
            text = await metrics_text(edge)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    labels = {s.labels["backend"] for s in families["quicedge_upstream_connections"].samples}
    assert names[kept.url] in labels and labels <= set(names.values()), labels


def test_an_exporter_that_is_not_installed_is_one_line() -> None:
    # Stands for an install without the `otlp` extra: the import of the exporter fails.
    code = (
        "import sys; sys.modules['opentelemetry.exporter.otlp.proto.http.trace_exporter'] = None;"
        "from edge.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    env = {**os.environ, "OTEL_TRACES_EXPORTER": "otlp"}
    done = subprocess.run(
        [sys.executable, "-c", code, "serve", "--backend", "http://127.0.0.1:9"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "OTEL_TRACES_EXPORTER=otlp" in lines[0] and "quicedge[otlp]" in lines[0]


@pytest.mark.parametrize(
    ("variables", "service"),
    [
        ({}, "quicedge"),
        ({"OTEL_RESOURCE_ATTRIBUTES": "service.name=edge-eu,deployment.environment=prod"},
         "edge-eu"),
        ({"OTEL_RESOURCE_ATTRIBUTES": "service.name=edge-eu", "OTEL_SERVICE_NAME": "edge-us"},
         "edge-us"),
    ],
)  # fmt: skip
def test_the_service_name_follows_the_sdk_variables_and_defaults_to_quicedge(
    monkeypatch: pytest.MonkeyPatch, variables: dict[str, str], service: str
) -> None:
    """OTEL_SERVICE_NAME over OTEL_RESOURCE_ATTRIBUTES' service.name, as the SDK's own
    precedence has it; `quicedge` only where neither names one."""
    for name in ("OTEL_RESOURCE_ATTRIBUTES", "OTEL_SERVICE_NAME"):
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    setup = tracer_from_env(force=True, environ={**os.environ, "OTEL_TRACES_EXPORTER": "console"})
    try:
        assert setup.provider is not None
        attributes = setup.provider.resource.attributes
        assert attributes["service.name"] == service
        if "deployment.environment" in variables.get("OTEL_RESOURCE_ATTRIBUTES", ""):
            assert attributes["deployment.environment"] == "prod"
    finally:
        setup.shutdown()


@pytest.mark.parametrize(
    "variables",
    [
        {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
        {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"},
        {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
         "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"},
    ],
)  # fmt: skip
def test_an_otlp_protocol_the_exporter_does_not_speak_is_one_line(
    variables: dict[str, str],
) -> None:
    """The exporter speaks OTLP over HTTP with protobuf only: set to gRPC (port 4317, as many
    collectors' settings say), it would post HTTP to a gRPC port and every span would be lost,
    with a warning now and then."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env |= {"OTEL_TRACES_EXPORTER": "otlp", **variables}
    done = subprocess.run(
        [sys.executable, "-m", "edge.cli", "serve", "--backend", "http://127.0.0.1:9", "--check"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    (name,) = [n for n, v in variables.items() if v != "http/protobuf"]
    assert name in lines[0] and "http/protobuf" in lines[0]


def test_the_otlp_protocol_the_exporter_speaks_is_taken() -> None:
    for variables in (
        {},
        {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"},
        {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
         "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"},
    ):  # fmt: skip
        assert exporter_names({"OTEL_TRACES_EXPORTER": "otlp", **variables}) == ["otlp"]
    # without the OTLP exporter, the protocol is nobody's business
    assert exporter_names(
        {"OTEL_TRACES_EXPORTER": "console", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    ) == ["console"]
