"""Pure helpers for the chart tests: split rendered templates into Kubernetes objects and check the
cross-references that the API server or the kubelet would only reject (or silently mishandle) on a cluster.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import yaml

WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
_VOLUME_SOURCES = (
    "emptyDir",
    "persistentVolumeClaim",
    "secret",
    "configMap",
    "hostPath",
    "projected",
    "csi",
    "nfs",
    "downwardAPI",
    "ephemeral",
)


@dataclass(frozen=True)
class Manifest:
    """One rendered Kubernetes object and the template it came from."""

    template: str
    obj: dict[str, Any]

    @property
    def kind(self) -> str:
        return str(self.obj["kind"])

    @property
    def name(self) -> str:
        return str(self.obj["metadata"]["name"])

    @property
    def is_hook(self) -> bool:
        return "helm.sh/hook" in (self.obj["metadata"].get("annotations") or {})


def split(rendered: dict[str, str]) -> list[Manifest]:
    """Objects of a `Chart.render` result; NOTES.txt and empty documents are skipped."""
    out: list[Manifest] = []
    for template, text in sorted(rendered.items()):
        if template.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                out.append(Manifest(template, doc))
    return out


def find(manifests: Iterable[Manifest], kind: str, name_suffix: str = "") -> list[Manifest]:
    return [m for m in manifests if m.kind == kind and m.name.endswith(name_suffix)]


def one(manifests: Iterable[Manifest], kind: str, name_suffix: str = "") -> Manifest:
    found = find(manifests, kind, name_suffix)
    assert len(found) == 1, f"expected one {kind} *{name_suffix}, got {[m.name for m in found]}"
    return found[0]


def pod_spec(m: Manifest) -> dict[str, Any]:
    if m.kind == "Pod":
        spec: dict[str, Any] = m.obj["spec"]
    else:
        spec = m.obj["spec"]["template"]["spec"]
    return spec


def pod_labels(m: Manifest) -> dict[str, str]:
    labels: dict[str, str] = (m.obj["metadata"] if m.kind == "Pod" else m.obj["spec"]["template"]["metadata"]).get(
        "labels"
    ) or {}
    return labels


def pods(manifests: Iterable[Manifest]) -> Iterator[Manifest]:
    for m in manifests:
        if m.kind in WORKLOAD_KINDS or m.kind == "Pod":
            yield m


def container(m: Manifest, name: str) -> dict[str, Any]:
    """The container (or init container) ``name`` of a workload's pod."""
    spec = pod_spec(m)
    for c in [*spec["containers"], *spec.get("initContainers", [])]:
        if c["name"] == name:
            return dict(c)
    raise AssertionError(f"{m.kind}/{m.name} has no container {name!r}")


def env_of(c: dict[str, Any]) -> dict[str, Any]:
    """Container env as name -> value (a string) or valueFrom (a dict)."""
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def problems(manifests: list[Manifest]) -> list[str]:
    """Cross-reference problems in a rendered release (empty when consistent)."""
    errs: list[str] = []
    by_kind_name = {(m.kind, m.name) for m in manifests}
    for m in manifests:
        where = f"{m.kind}/{m.name}"
        if not _DNS_SUBDOMAIN.match(m.name) or len(m.name) > 63:
            errs.append(f"{where}: name is not a DNS label of at most 63 characters")
        for key, value in (m.obj["metadata"].get("labels") or {}).items():
            if len(str(value)) > 63:
                errs.append(f"{where}: label {key} longer than 63 characters")
    for m in pods(manifests):
        errs.extend(_pod_problems(m))
        if m.kind != "Pod":
            selector = m.obj["spec"]["selector"]["matchLabels"]
            if not selects(selector, pod_labels(m)):
                errs.append(f"{m.kind}/{m.name}: selector {selector} does not match its pod labels")
        if m.kind == "StatefulSet":
            svc = m.obj["spec"]["serviceName"]
            headless = [s for s in find(manifests, "Service") if s.name == svc]
            if not headless or headless[0].obj["spec"].get("clusterIP") != "None":
                errs.append(f"StatefulSet/{m.name}: serviceName {svc} is not a rendered headless Service")
            max_pod = f"{m.name}-{int(m.obj['spec'].get('replicas', 1) or 1) - 1}"
            if not _DNS_LABEL.match(max_pod) or len(max_pod) > 63:
                errs.append(f"StatefulSet/{m.name}: pod name {max_pod} is not a valid DNS label")
    workloads = [w for w in pods(manifests) if w.kind != "Pod"]
    for svc in find(manifests, "Service"):
        selector = svc.obj["spec"].get("selector") or {}
        targets = [w for w in workloads if selects(selector, pod_labels(w))]
        if not targets:
            errs.append(f"Service/{svc.name}: selector {selector} matches no workload")
        for port in svc.obj["spec"]["ports"]:
            target = port.get("targetPort")
            if isinstance(target, str):
                for w in targets:
                    names = {p["name"] for c in pod_spec(w)["containers"] for p in c.get("ports", [])}
                    if target not in names:
                        errs.append(f"Service/{svc.name}: targetPort {target} is not a port of {w.kind}/{w.name}")
    for pdb in find(manifests, "PodDisruptionBudget"):
        if not any(selects(pdb.obj["spec"]["selector"]["matchLabels"], pod_labels(w)) for w in workloads):
            errs.append(f"PodDisruptionBudget/{pdb.name}: selects no workload")
    for hpa in find(manifests, "HorizontalPodAutoscaler"):
        ref = hpa.obj["spec"]["scaleTargetRef"]
        if (ref["kind"], ref["name"]) not in by_kind_name:
            errs.append(f"HorizontalPodAutoscaler/{hpa.name}: target {ref['kind']}/{ref['name']} is not rendered")
        if hpa.obj["spec"]["minReplicas"] > hpa.obj["spec"]["maxReplicas"]:
            errs.append(f"HorizontalPodAutoscaler/{hpa.name}: minReplicas > maxReplicas")
    for ing in find(manifests, "Ingress"):
        for rule in ing.obj["spec"]["rules"]:
            for path in rule["http"]["paths"]:
                backend = path["backend"]["service"]
                if ("Service", backend["name"]) not in by_kind_name:
                    errs.append(f"Ingress/{ing.name}: backend Service {backend['name']} is not rendered")
    for rb in find(manifests, "RoleBinding"):
        if ("Role", rb.obj["roleRef"]["name"]) not in by_kind_name:
            errs.append(f"RoleBinding/{rb.name}: Role {rb.obj['roleRef']['name']} is not rendered")
    return errs


def _pod_problems(m: Manifest) -> list[str]:
    errs: list[str] = []
    where = f"{m.kind}/{m.name}"
    spec = pod_spec(m)
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    claim_templates = (
        {t["metadata"]["name"] for t in m.obj["spec"].get("volumeClaimTemplates", [])}
        if m.kind == ("StatefulSet")
        else set()
    )
    for name, vol in volumes.items():
        sources = [k for k in _VOLUME_SOURCES if vol.get(k) is not None]
        if len(sources) != 1:
            errs.append(f"{where}: volume {name} needs exactly one source, has {sources}")
    for c in spec["containers"]:
        cwhere = f"{where} container {c['name']}"
        port_names = {p["name"] for p in c.get("ports", [])}
        for mount in c.get("volumeMounts", []):
            if mount["name"] not in volumes and mount["name"] not in claim_templates:
                errs.append(f"{cwhere}: volumeMount {mount['name']} has no volume")
        for probe_name in ("startupProbe", "livenessProbe", "readinessProbe"):
            probe = c.get(probe_name)
            if probe is None:
                continue
            handler = probe.get("httpGet") or probe.get("tcpSocket") or {}
            port = handler.get("port")
            if isinstance(port, str) and port not in port_names:
                errs.append(f"{cwhere}: {probe_name} port {port} is not a named container port")
        defined: set[str] = set()
        for e in c.get("env", []):
            for ref in _VAR_REF.findall(str(e.get("value", ""))):
                if ref not in defined:
                    errs.append(f"{cwhere}: env {e['name']} uses $({ref}) before it is defined")
            defined.add(e["name"])
        for arg in [*c.get("command", []), *c.get("args", [])]:
            for ref in _VAR_REF.findall(str(arg)):
                if ref not in defined:
                    errs.append(f"{cwhere}: argument {arg!r} uses $({ref}), which is not in env")
    return errs


#: what an agent that runs jobs as uids of their own keeps (it runs as root with only these)
JOB_ISOLATION_CAPS = {"CHOWN", "KILL", "SETGID", "SETUID"}


def _isolating_agent(spec: dict[str, Any]) -> bool:
    """An agent container with --job-uid-range, whose root keeps no capability beyond :data:`JOB_ISOLATION_CAPS`."""
    cs = spec["containers"]
    return (
        len(cs) == 1
        and cs[0]["name"] == "agent"
        and "ETRAIN_JOB_UID_RANGE" in env_of(cs[0])
        and set(((cs[0].get("securityContext") or {}).get("capabilities") or {}).get("add") or []) <= JOB_ISOLATION_CAPS
    )


def security_problems(m: Manifest) -> list[str]:
    """What keeps a pod from running non-root with a read-only root file system and no privileges (an agent that
    runs jobs as uids of their own: as root, with every capability dropped but :data:`JOB_ISOLATION_CAPS`)."""
    errs: list[str] = []
    spec = pod_spec(m)
    psc = spec.get("securityContext") or {}
    where = f"{m.kind}/{m.name}"
    if (psc.get("runAsNonRoot") is not True or int(psc.get("runAsUser", 0)) == 0) and not _isolating_agent(spec):
        errs.append(f"{where}: pod does not run as a non-root user")
    if (psc.get("seccompProfile") or {}).get("type") != "RuntimeDefault":
        errs.append(f"{where}: no RuntimeDefault seccomp profile")
    for c in spec["containers"]:
        csc = c.get("securityContext") or {}
        if csc.get("allowPrivilegeEscalation") is not False:
            errs.append(f"{where}/{c['name']}: privilege escalation allowed")
        if csc.get("readOnlyRootFilesystem") is not True:
            errs.append(f"{where}/{c['name']}: root file system is writable")
        if "ALL" not in ((csc.get("capabilities") or {}).get("drop") or []):
            errs.append(f"{where}/{c['name']}: capabilities are not all dropped")
        added = set((csc.get("capabilities") or {}).get("add") or [])
        if added and not (_isolating_agent(spec) and added <= JOB_ISOLATION_CAPS):
            errs.append(f"{where}/{c['name']}: capabilities added: {sorted(added)}")
        if "resources" not in c or not c["resources"]:
            errs.append(f"{where}/{c['name']}: no resources")
    return errs
