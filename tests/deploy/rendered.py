"""Run what the chart renders on this machine: the in-cluster etcd members with their rendered command
line (TLS flags and certificates included), and the etrain containers' env with their Secret volumes
written to files. Kubernetes names become loopback addresses, mount paths become temporary files; nothing
else of the rendered arguments is changed."""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.deploy import manifests as mf
from tests.deploy.conftest import NAMESPACE


def secret_data(objects: list[mf.Manifest], name: str) -> dict[str, bytes]:
    """The keys of a rendered Secret, decoded (data is base64, stringData plain)."""
    secret = next(m for m in objects if m.kind == "Secret" and m.name == name)
    out = {k: base64.b64decode(v) for k, v in (secret.obj.get("data") or {}).items()}
    out.update({k: str(v).encode() for k, v in (secret.obj.get("stringData") or {}).items()})
    return out


def mounted_secret_keys(workload: mf.Manifest, container: dict[str, Any]) -> dict[str, tuple[str, str, int]]:
    """Container file path -> (Secret name, key, file mode) for the container's Secret volume mounts; only
    the items each volume selects, as the kubelet projects them."""
    volumes = {v["name"]: v for v in mf.pod_spec(workload).get("volumes", [])}
    out: dict[str, tuple[str, str, int]] = {}
    for mount in container.get("volumeMounts", []):
        volume = volumes.get(mount["name"]) or {}
        secret = volume.get("secret")
        if secret:
            for item in secret["items"]:
                mode = int(secret.get("defaultMode", 0o644))
                out[f"{mount['mountPath']}/{item['path']}"] = (secret["secretName"], item["key"], mode)
        projected = volume.get("projected")
        if projected:  # several Secrets' keys in one directory
            mode = int(projected.get("defaultMode", 0o644))
            for source in projected["sources"]:
                for item in source["secret"]["items"]:
                    out[f"{mount['mountPath']}/{item['path']}"] = (source["secret"]["name"], item["key"], mode)
    return out


def write_mounted_secrets(
    objects: list[mf.Manifest], workload: mf.Manifest, container: dict[str, Any], root: Path
) -> dict[str, str]:
    """Write the files that the container's Secret volumes would hold under ``root``; returns container
    path -> local path."""
    out: dict[str, str] = {}
    for path, (secret, key, mode) in mounted_secret_keys(workload, container).items():
        directory, _, base = path.rpartition("/")
        local = root / directory.strip("/").replace("/", "_") / base  # one local directory per mounted one
        local.parent.mkdir(parents=True, exist_ok=True)
        local.write_bytes(secret_data(objects, secret)[key])
        local.chmod(mode & 0o700)  # one user here: the owner bits of the volume's mode
        out[path] = str(local)
    return out


@dataclass
class RenderedEtcd:
    """The rendered etcd StatefulSet's members as local processes: one per replica, each with its own
    client, peer and metrics port on 127.0.0.1."""

    objects: list[mf.Manifest]
    workdir: Path
    ports: dict[str, dict[str, int]] = field(default_factory=dict)  # member -> port name -> local port
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def __post_init__(self) -> None:
        from elastic.testing.etcd_server import free_port

        self.sts = mf.one(self.objects, "StatefulSet", "-etcd")
        self.container = mf.container(self.sts, "etcd")
        self.domain = f"{self.sts.obj['spec']['serviceName']}.{NAMESPACE}.svc.cluster.local"
        self.members = [f"{self.sts.name}-{i}" for i in range(int(self.sts.obj["spec"]["replicas"]))]
        self.container_ports = {p["name"]: int(p["containerPort"]) for p in self.container["ports"]}
        for member in self.members:
            self.ports[member] = {name: free_port() for name in self.container_ports}

    def localize(self, text: str) -> str:
        """Member DNS names (with their ports) -> 127.0.0.1 and the member's local port."""
        for member in self.members:
            for name, port in self.container_ports.items():
                text = text.replace(f"{member}.{self.domain}:{port}", f"127.0.0.1:{self.ports[member][name]}")
        return text

    def args(self, member: str, files: dict[str, str]) -> list[str]:
        out: list[str] = []
        for arg in self.container["args"]:
            arg = self.localize(arg.replace("$(POD_NAME)", member))
            for name, port in self.container_ports.items():
                arg = arg.replace(f"0.0.0.0:{port}", f"127.0.0.1:{self.ports[member][name]}")
            for path, local in files.items():
                arg = arg.replace(path, local)
            if arg.startswith("--data-dir="):
                arg = f"--data-dir={self.workdir / member}"
            out.append(arg)
        leftovers = [a for a in out if re.search(r"0\.0\.0\.0|svc\.cluster|/etc/|\$\(", a)]
        assert leftovers == [], f"rendered etcd arguments not mapped to this machine: {leftovers}"
        return out

    def start(self, timeout: float = 30) -> RenderedEtcd:
        from elastic.testing.etcd_server import find_etcd_binary

        assert self.container["command"] == ["/usr/local/bin/etcd"]
        self.workdir.mkdir(parents=True, exist_ok=True)
        files = write_mounted_secrets(self.objects, self.sts, self.container, self.workdir / "files")
        for member in self.members:
            with open(self.workdir / f"{member}.log", "ab") as log:
                self.procs.append(
                    subprocess.Popen(
                        [find_etcd_binary(), *self.args(member, files)],
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        for member in self.members:
            self.wait_ready(member, timeout)
        return self

    def wait_ready(self, member: str, timeout: float) -> None:
        """Poll the member's rendered readiness probe (an HTTP GET on a named port) until it answers
        {"health": "true"}, as the kubelet would."""
        probe = self.container["readinessProbe"]["httpGet"]
        url = f"http://127.0.0.1:{self.ports[member][probe['port']]}{probe['path']}"
        deadline = time.monotonic() + timeout
        while True:
            for proc in self.procs:
                if proc.poll() is not None:
                    raise AssertionError(f"an etcd member exited: {self.logs()[-4000:]}")
            try:
                with urllib.request.urlopen(url, timeout=2) as resp:
                    if json.loads(resp.read()).get("health") == "true":
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"{member} not ready at {url}: {self.logs()[-4000:]}")
            time.sleep(0.2)

    def logs(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in sorted(self.workdir.glob("*.log")))

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)


def expand_env(env: list[dict[str, Any]], overrides: dict[str, str], fields: dict[str, str]) -> dict[str, str]:
    """A container's env as the kubelet builds it: downward-API fields filled in, `$(VAR)` expanded from
    variables defined earlier in the list; secret references are left out."""
    out: dict[str, str] = {}
    for item in env:
        name = item["name"]
        if name in overrides:
            value = overrides[name]
        elif "value" in item:
            value = re.sub(r"\$\(([A-Za-z_]\w*)\)", lambda m: out.get(m.group(1), m.group(0)), str(item["value"]))
        elif "fieldRef" in item.get("valueFrom", {}):
            value = fields[item["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            continue
        out[name] = value
    return out


def etrain_process(
    objects: list[mf.Manifest],
    workload: mf.Manifest,
    name: str,
    etcd: RenderedEtcd | None,
    tmp: Path,
    overrides: dict[str, str],
    fields: dict[str, str] | None = None,
    log: Path | None = None,
) -> subprocess.Popen[bytes]:
    """Start the rendered container ``name`` of ``workload`` (command `etrain ...`) as a local process:
    env expanded, its Secret volumes written under ``tmp``, mount paths in the env pointing at those files
    and etcd member names at the local members."""
    container = mf.container(workload, name)
    assert container["command"][0] == "etrain"
    files = write_mounted_secrets(objects, workload, container, tmp / f"{name}-files")
    env = expand_env(container["env"], {"HOME": str(tmp), **overrides}, fields or {})
    env = {k: files.get(v, etcd.localize(v) if etcd else v) for k, v in env.items()}
    # the container's per-job uids (root with four capabilities, a work dir of its own) are checked on the rendered
    # objects (test_chart_security); this local process keeps pytest's root-only directories: no uid switch here
    env.pop("ETRAIN_JOB_UID_RANGE", None)
    # an argument naming a mounted directory (e.g. --node-password-dir) points at its local copy
    mounts = {
        m["mountPath"]: str(tmp / f"{name}-files" / m["mountPath"].strip("/").replace("/", "_"))
        for m in container.get("volumeMounts", [])
    }
    argv = [
        sys.executable,
        "-c",
        "import sys; from service.cli.main import main; sys.exit(main())",
        *container["command"][1:],
        *(mounts.get(a, a) for a in container.get("args", [])),
    ]
    base = {k: v for k, v in os.environ.items() if not k.startswith("ETRAIN_")}
    full_env = {**base, **env, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    with open(log or tmp / f"{name}.log", "ab") as out:
        return subprocess.Popen(argv, env=full_env, stdout=out, stderr=subprocess.STDOUT)


def run_etcd_bootstrap(
    objects: list[mf.Manifest],
    etcd: RenderedEtcd,
    tmp: Path,
    overrides: dict[str, str] | None = None,
    timeout: float = 60,
) -> str:
    """Run the controller pod's init container ``etcd-bootstrap`` (as the kubelet would, before the controller)
    to its end; returns what it printed. With the chart's defaults the etcd has no users before it."""
    deploy = mf.one(objects, "Deployment")
    proc = etrain_process(objects, deploy, "etcd-bootstrap", etcd, tmp, overrides or {})
    code = proc.wait(timeout=timeout)
    out = (tmp / "etcd-bootstrap.log").read_text()
    assert code == 0, out
    return out


def stop(proc: subprocess.Popen[bytes], timeout: float = 30) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)
