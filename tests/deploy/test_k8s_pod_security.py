"""The Pod Security Standards every pod of the Kubernetes manifests meets, checked offline on
the rendered overlays (the levels' rules as kubernetes.io/docs/concepts/security/
pod-security-standards lists them)."""

from __future__ import annotations

from typing import Any

from tests.deploy.test_manifests import one, render

NAMESPACE = "quicedge"

RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                      "persistentVolumeClaim", "projected", "secret"}  # fmt: skip
BASELINE_CAPABILITIES = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL",
                         "MKNOD", "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID",
                         "SYS_CHROOT"}  # fmt: skip


def baseline_violations(spec: dict[str, Any]) -> list[str]:
    """What in a pod spec the Pod Security Standards' "baseline" level forbids."""
    found = [f"{k}" for k in ("hostNetwork", "hostPID", "hostIPC") if spec.get(k)]
    found += [f"volume {v['name']}: hostPath" for v in spec.get("volumes", []) if "hostPath" in v]
    pod = spec.get("securityContext", {})
    if pod.get("seccompProfile", {}).get("type") == "Unconfined":
        found.append("pod seccomp Unconfined")
    for c in [*spec.get("initContainers", []), *spec["containers"]]:
        context = c.get("securityContext", {})
        if context.get("privileged"):
            found.append(f"{c['name']}: privileged")
        extra = set(context.get("capabilities", {}).get("add", [])) - BASELINE_CAPABILITIES
        if extra:
            found.append(f"{c['name']}: capabilities {sorted(extra)}")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            found.append(f"{c['name']}: hostPort")
        if context.get("seccompProfile", {}).get("type") == "Unconfined":
            found.append(f"{c['name']}: seccomp Unconfined")
        if context.get("procMount", "Default") != "Default":
            found.append(f"{c['name']}: procMount")
    return found


def restricted_violations(spec: dict[str, Any]) -> list[str]:
    """What in a pod spec the "restricted" level forbids (it includes "baseline")."""
    found = baseline_violations(spec)
    pod = spec.get("securityContext", {})
    for v in spec.get("volumes", []):
        kinds = set(v) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            found.append(f"volume {v['name']}: {sorted(kinds)}")
    if pod.get("runAsUser") == 0:
        found.append("pod runAsUser 0")
    for c in [*spec.get("initContainers", []), *spec["containers"]]:
        context = c.get("securityContext", {})
        name = c["name"]
        if context.get("allowPrivilegeEscalation") is not False:
            found.append(f"{name}: allowPrivilegeEscalation not false")
        if context.get("runAsNonRoot", pod.get("runAsNonRoot")) is not True:
            found.append(f"{name}: runAsNonRoot not true")
        if context.get("runAsUser", pod.get("runAsUser")) == 0:
            found.append(f"{name}: runAsUser 0")
        seccomp = context.get("seccompProfile", pod.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            found.append(f"{name}: seccompProfile {seccomp}")
        capabilities = context.get("capabilities", {})
        if "ALL" not in capabilities.get("drop", []):
            found.append(f"{name}: capabilities not dropped")
        if set(capabilities.get("add", [])) - {"NET_BIND_SERVICE"}:
            found.append(f"{name}: capabilities added")
    return found


def test_every_pod_of_the_cpu_stack_meets_the_restricted_level() -> None:
    """Redis holds what the fleet's replay protection and drains rest on; the stand-ins run
    the same image as the edge. None needs root."""
    docs = render("cpu")
    for deployment in (d for d in docs if d["kind"] == "Deployment"):
        spec = deployment["spec"]["template"]["spec"]
        assert restricted_violations(spec) == [], deployment["metadata"]["name"]


def test_the_gpu_stack_meets_baseline_and_its_edge_and_redis_restricted() -> None:
    """SGLang's image runs as root (its caches under /root): baseline, not restricted. The
    namespace enforces what every pod of both overlays meets and warns of the rest."""
    docs = render("gpu")
    for deployment in (d for d in docs if d["kind"] == "Deployment"):
        spec = deployment["spec"]["template"]["spec"]
        assert baseline_violations(spec) == [], deployment["metadata"]["name"]
        if deployment["metadata"]["name"] != "sglang":
            assert restricted_violations(spec) == [], deployment["metadata"]["name"]
    labels = one(docs, "Namespace", NAMESPACE)["metadata"].get("labels", {})
    assert labels.get("pod-security.kubernetes.io/enforce") == "baseline"
    assert labels.get("pod-security.kubernetes.io/warn") == "restricted"


def test_the_checker_finds_what_restricted_forbids() -> None:
    spec = {"containers": [{"name": "c", "securityContext": {}}],
            "volumes": [{"name": "h", "hostPath": {"path": "/"}}]}  # fmt: skip
    found = restricted_violations(spec)
    assert "volume h: hostPath" in found
    assert "c: allowPrivilegeEscalation not false" in found
    assert "c: runAsNonRoot not true" in found
    assert "c: seccompProfile None" in found
    assert "c: capabilities not dropped" in found
