"""The Helm chart, checked with the real Helm SDK (helm-python-sdk: Helm's Go code, no helm binary):
lint, values schema, render, `install --dry-run=client`, and every rendered object validated against
the Kubernetes OpenAPI schemas (kubernetes-validate) of the oldest supported and the current version."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.deploy import manifests as mf
from tests.deploy import rendered as rd
from tests.deploy.conftest import CHART_DIR, CI_VALUES, NAMESPACE, RELEASE, load_values

pytestmark = pytest.mark.timeout(120)

CURRENT_KUBE = kubernetes_validate.latest_version()  # the newest schemas the package ships (1.37 or later)
OLDEST_KUBE = "1.29.0"  # Chart.yaml kubeVersion: >=1.29.0-0


def render(chart: helm.Chart, values: dict[str, Any] | None) -> list[mf.Manifest]:
    return mf.split(chart.render(values, name=RELEASE, namespace=NAMESPACE))


def by_name(stem: str) -> dict[str, Any]:
    return load_values(CHART_DIR / "ci" / f"{stem}-values.yaml")


# --- the values variants -------------------------------------------------------------------------------


def test_ci_values_cover_external_etcd_s3_lustre_and_auth() -> None:
    names = {p.name for p in CI_VALUES}
    assert {
        "external-etcd-values.yaml",
        "s3-values.yaml",
        "lustre-pvc-values.yaml",
        "auth-values.yaml",
    } <= names


def test_chart_metadata_matches_the_package() -> None:
    meta = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())
    pyproject = (CHART_DIR.parents[1] / "pyproject.toml").read_text()
    version = re.search(r'^version = "([^"]+)"', pyproject, re.M)
    assert version is not None
    assert meta["appVersion"] == version.group(1)
    assert meta["apiVersion"] == "v2" and meta["kubeVersion"] == f">={OLDEST_KUBE}-0"


def test_lint_is_clean_in_strict_mode(ci_values_file: Path) -> None:
    for kube in (OLDEST_KUBE, CURRENT_KUBE):
        report = helm.lint(CHART_DIR, load_values(ci_values_file), strict=True, kube_version=f"v{kube}")
        serious = [m for m in report["messages"] if m["severity"] >= 2]
        assert report["errors"] == [] and serious == [], (kube, report)
        assert report["total_charts_linted"] == 1


def test_values_pass_the_chart_schema(chart: helm.Chart, ci_values_file: Path) -> None:
    merged = chart.merge_values(load_values(ci_values_file))
    chart.validate_schema(merged)  # raises HelmValuesError naming the key on failure


def test_rendered_objects_are_valid_kubernetes(chart: helm.Chart, ci_values_file: Path) -> None:
    objects = render(chart, load_values(ci_values_file))
    assert len(objects) >= 8
    invalid: list[str] = []
    for kube in (OLDEST_KUBE, CURRENT_KUBE):
        for m in objects:
            try:
                kubernetes_validate.validate(m.obj, kube, strict=True)
            except kubernetes_validate.ValidationError as exc:
                path = "/".join(str(p) for p in exc.path)
                invalid.append(
                    f"{m.template}: {m.kind}/{m.name} invalid for Kubernetes {kube} at {path}: {exc.message}"
                )
    assert invalid == []


def test_rendered_objects_reference_each_other_consistently(chart: helm.Chart, ci_values_file: Path) -> None:
    assert mf.problems(render(chart, load_values(ci_values_file))) == []


def test_every_pod_runs_non_root_read_only_without_privileges(chart: helm.Chart, ci_values_file: Path) -> None:
    objects = render(chart, load_values(ci_values_file))
    all_pods = list(mf.pods(objects))
    assert {m.name.rsplit("-", 1)[-1] for m in all_pods} >= {"controller", "agent", "readyz"}
    assert [p for m in all_pods for p in mf.security_problems(m)] == []


def test_install_dry_run_succeeds_and_notes_name_the_checkpoint_url(chart: helm.Chart, ci_values_file: Path) -> None:
    values = load_values(ci_values_file)
    with helm.Config(namespace=NAMESPACE) as cfg:
        release = cfg.install(chart, RELEASE, values, dry_run="client", namespace=NAMESPACE)
    installed = [doc for doc in yaml.safe_load_all(release["manifest"]) if doc]
    rendered = [m for m in render(chart, values) if not m.is_hook]
    assert sorted((d["kind"], d["metadata"]["name"]) for d in installed) == sorted((m.kind, m.name) for m in rendered)
    merged = chart.merge_values(values)
    storage = merged["storage"]
    if storage["type"] == "s3":
        expected = f"s3://{storage['s3']['bucket']}/{storage['s3']['prefix']}/<job-id>"
    else:
        expected = f"{storage['mountPath']}/checkpoints/<job-id>"
    assert expected in release["notes"]
    assert f"helm test {RELEASE} -n {NAMESPACE}" in release["notes"]


# --- what each variant must produce --------------------------------------------------------------------


def test_in_cluster_etcd_members_bootstrap_one_cluster(chart: helm.Chart) -> None:
    objects = render(chart, by_name("auth"))  # 5 members
    sts = mf.one(objects, "StatefulSet", "-etcd")
    assert sts.obj["spec"]["replicas"] == 5
    assert sts.obj["spec"]["podManagementPolicy"] == "Parallel"
    args = mf.container(sts, "etcd")["args"]
    initial = next(a for a in args if a.startswith("--initial-cluster="))
    members = dict(item.split("=", 1) for item in initial.split("=", 1)[1].split(","))
    assert sorted(members) == [f"{sts.name}-{i}" for i in range(5)]
    headless = sts.obj["spec"]["serviceName"]
    for name, url in members.items():  # peers talk TLS by default (etcd.tls.enabled)
        assert url == f"https://{name}.{headless}.{NAMESPACE}.svc.cluster.local:2380"
    svc = next(m for m in mf.find(objects, "Service") if m.name == headless)
    assert svc.obj["spec"]["publishNotReadyAddresses"] is True
    assert mf.one(objects, "PodDisruptionBudget", "-etcd").obj["spec"]["minAvailable"] == 3
    endpoints = mf.env_of(mf.container(mf.one(objects, "Deployment", "-controller"), "controller"))[
        "ETRAIN_ETCD_ENDPOINTS"
    ]
    assert endpoints.split(",") == [f"https://{name}.{headless}.{NAMESPACE}.svc.cluster.local:2379" for name in members]
    claims = sts.obj["spec"]["volumeClaimTemplates"]
    assert claims[0]["spec"]["accessModes"] == ["ReadWriteOnce"]


def test_external_etcd_replaces_the_in_cluster_one_and_mounts_tls_and_password(chart: helm.Chart) -> None:
    values = by_name("external-etcd")
    objects = render(chart, values)
    assert [m for m in objects if m.name.endswith(("-etcd", "-etcd-headless"))] == []
    for workload, name in (
        (mf.one(objects, "Deployment"), "controller"),
        (mf.one(objects, "StatefulSet"), "agent"),
    ):
        c = mf.container(workload, name)
        env = mf.env_of(c)
        assert env["ETRAIN_ETCD_ENDPOINTS"] == ",".join(values["etcd"]["external"]["endpoints"])
        assert env["ETRAIN_PREFIX"] == "/teams/vision/etrain"
        assert env["ETRAIN_ETCD_USER"] == "etrain"
        mounted = _mounted_files(workload, c)
        for var, secret in (
            ("ETRAIN_ETCD_CA_CERT", "etrain-etcd-client-tls"),
            ("ETRAIN_ETCD_CERT", "etrain-etcd-client-tls"),
            ("ETRAIN_ETCD_KEY", "etrain-etcd-client-tls"),
            ("ETRAIN_ETCD_PASSWORD_FILE", "etrain-etcd-password"),
        ):
            assert mounted.get(env[var]) == secret, (var, env[var], mounted)
    role = mf.one(objects, "Role")
    assert role.obj["rules"] == [
        {
            "apiGroups": [""],
            "resources": ["secrets"],
            # the generated API tokens (auth is on by default) and the external etcd's credentials
            "resourceNames": ["demo-etrain-auth", "etrain-etcd-client-tls", "etrain-etcd-password"],
            "verbs": ["get"],
        }
    ]
    hpa = mf.one(objects, "HorizontalPodAutoscaler")
    assert (hpa.obj["spec"]["minReplicas"], hpa.obj["spec"]["maxReplicas"]) == (2, 8)
    agents = mf.one(objects, "StatefulSet", "-agent")
    assert "replicas" not in agents.obj["spec"]  # the autoscaler owns it
    env = mf.env_of(mf.container(agents, "agent"))
    assert env["ETRAIN_RDZV_HOST"] == f"$(POD_NAME).{agents.name}.{NAMESPACE}.svc.cluster.local"


def test_s3_storage_exports_credentials_from_the_secret(chart: helm.Chart) -> None:
    objects = render(chart, by_name("s3"))
    assert mf.find(objects, "PersistentVolumeClaim") == []
    for workload, name in (
        (mf.one(objects, "Deployment"), "controller"),
        (mf.one(objects, "StatefulSet", "-agent"), "agent"),
    ):
        env = mf.env_of(mf.container(workload, name))
        assert env["AWS_ACCESS_KEY_ID"] == {
            "secretKeyRef": {"name": "etrain-s3-credentials", "key": "AWS_ACCESS_KEY_ID"}
        }
        assert env["AWS_SECRET_ACCESS_KEY"] == {
            "secretKeyRef": {"name": "etrain-s3-credentials", "key": "AWS_SECRET_ACCESS_KEY"}
        }
        assert env["AWS_ENDPOINT_URL_S3"] == "https://minio.storage.svc:9000"
        assert env["AWS_REGION"] == "us-east-1"
        assert "shared" not in {v["name"] for v in mf.pod_spec(workload).get("volumes", [])}
    agents = mf.one(objects, "StatefulSet", "-agent")
    spec = mf.pod_spec(agents)
    assert spec["hostNetwork"] is True and spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    env = mf.env_of(mf.container(agents, "agent"))
    assert env["ETRAIN_RDZV_HOST"] == "$(POD_IP)" and env["ETRAIN_NPROC_PER_NODE"] == "2"
    assert agents.obj["spec"]["replicas"] == 4


def test_lustre_claim_is_read_write_many_and_mounted_at_one_path_everywhere(chart: helm.Chart) -> None:
    objects = render(chart, by_name("lustre-pvc"))
    pvc = mf.one(objects, "PersistentVolumeClaim")
    assert pvc.obj["spec"]["accessModes"] == ["ReadWriteMany"]
    assert pvc.obj["spec"]["storageClassName"] == "lustre-csi"
    assert pvc.obj["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    for workload, name in (
        (mf.one(objects, "Deployment"), "controller"),
        (mf.one(objects, "DaemonSet"), "agent"),
    ):
        volumes = {v["name"]: v for v in mf.pod_spec(workload)["volumes"]}
        assert volumes["shared"]["persistentVolumeClaim"]["claimName"] == pvc.name
        mounts = {m["name"]: m["mountPath"] for m in mf.container(workload, name)["volumeMounts"]}
        assert mounts["shared"] == "/lustre/etrain"


def test_gpu_daemonset_gets_every_gpu_and_one_worker_per_gpu(chart: helm.Chart) -> None:
    objects = render(chart, by_name("lustre-pvc"))
    ds = mf.one(objects, "DaemonSet")
    agent = mf.container(ds, "agent")
    assert agent["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert agent["resources"]["requests"] == {"cpu": "1", "memory": "2Gi"}
    env = mf.env_of(agent)
    assert env["ETRAIN_NPROC_PER_NODE"] == "8"
    assert env["ETRAIN_NODE_NAME"] == "$(K8S_NODE_NAME)"
    assert env["K8S_NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert env["NCCL_SOCKET_IFNAME"] == "eth0"
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    spec = mf.pod_spec(ds)
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert spec["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert agent["image"] == "etrain:0.1.0-cuda"
    shm = next(v for v in spec["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
    assert mf.find(objects, "PodDisruptionBudget", "-agent") == []  # drains skip DaemonSet pods anyway


def test_auth_tokens_reach_the_controller_as_its_tokens_file(chart: helm.Chart) -> None:
    values = by_name("auth")
    objects = render(chart, values)
    secret = mf.one(objects, "Secret", "-auth")
    tokens = yaml.safe_load(secret.obj["stringData"]["tokens.yaml"])
    assert tokens == {"tokens": values["auth"]["tokens"]}
    deploy = mf.one(objects, "Deployment")
    c = mf.container(deploy, "controller")
    assert _mounted_files(deploy, c)[mf.env_of(c)["ETRAIN_TOKENS_FILE"]] == secret.name
    assert re.fullmatch(r"[0-9a-f]{64}", deploy.obj["spec"]["template"]["metadata"]["annotations"]["checksum/auth"])
    ingress = mf.one(objects, "Ingress")
    backend = ingress.obj["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": mf.one(objects, "Service", "-controller").name, "port": {"name": "http"}}
    assert ingress.obj["spec"]["tls"][0]["secretName"] == "etrain-tls"
    # auth explicitly off: no Secret, no tokens file
    plain = render(chart, _merge(by_name("lustre-pvc"), {"auth": {"enabled": False, "allowInsecure": True}}))
    assert mf.find(plain, "Secret", "-auth") == []
    assert "ETRAIN_TOKENS_FILE" not in mf.env_of(mf.container(mf.one(plain, "Deployment"), "controller"))


def test_controller_quotas_reach_the_controller_as_its_quotas_file(chart: helm.Chart, tmp_path: Path) -> None:
    from service.core.config import load_quotas
    from service.core.view import Quotas

    values = by_name("s3")
    objects = render(chart, values)
    config_map = mf.one(objects, "ConfigMap", "-quotas")
    rendered = tmp_path / "quotas.yaml"
    rendered.write_text(config_map.obj["data"]["quotas.yaml"])
    assert load_quotas(rendered) == Quotas(users={"ci-pipeline": 4}, queues={"team-a": 6}, default_user=2)
    deploy = mf.one(objects, "Deployment")
    c = mf.container(deploy, "controller")
    path = mf.env_of(c)["ETRAIN_QUOTAS_FILE"]
    volumes = {v["name"]: v for v in mf.pod_spec(deploy)["volumes"]}
    mounted = {
        f"{m['mountPath']}/{item['path']}": volumes[m["name"]]["configMap"]["name"]
        for m in c["volumeMounts"]
        if "configMap" in volumes[m["name"]]
        for item in volumes[m["name"]]["configMap"]["items"]
    }
    assert mounted == {path: config_map.name}
    assert re.fullmatch(r"[0-9a-f]{64}", deploy.obj["spec"]["template"]["metadata"]["annotations"]["checksum/quotas"])
    # no quotas: no ConfigMap, no file
    plain = render(chart, by_name("lustre-pvc"))
    assert mf.find(plain, "ConfigMap", "-quotas") == []
    assert "ETRAIN_QUOTAS_FILE" not in mf.env_of(mf.container(mf.one(plain, "Deployment"), "controller"))


def test_controller_and_agent_probes_use_the_cli_health_endpoints(chart: helm.Chart) -> None:
    objects = render(chart, by_name("s3"))
    controller = mf.container(mf.one(objects, "Deployment"), "controller")
    assert controller["command"] == ["etrain", "controller"]
    assert controller["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert controller["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    env = mf.env_of(controller)
    assert (env["ETRAIN_HOST"], env["ETRAIN_PORT"]) == ("0.0.0.0", "8080")
    agent = mf.container(mf.one(objects, "StatefulSet", "-agent"), "agent")
    assert agent["command"] == ["etrain", "agent"]
    assert agent["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert mf.env_of(agent)["ETRAIN_HEALTH_PORT"] == str(agent["ports"][0]["containerPort"]) == "8081"
    assert mf.env_of(agent)["ETRAIN_LOGS_PORT"] == str(agent["ports"][1]["containerPort"]) == "8082"
    assert agent["ports"][1]["name"] == "logs"
    no_logs = {**by_name("s3"), "agent": {**by_name("s3").get("agent", {}), "logsPort": 0}}
    off = mf.container(mf.one(render(chart, no_logs), "StatefulSet", "-agent"), "agent")
    assert mf.env_of(off)["ETRAIN_LOGS_PORT"] == "0" and [p["name"] for p in off["ports"]] == ["health"]


def test_helm_test_hook_requests_the_controller_readyz(chart: helm.Chart) -> None:
    objects = render(chart, by_name("auth"))
    pod = mf.one(objects, "Pod")
    annotations = pod.obj["metadata"]["annotations"]
    assert annotations["helm.sh/hook"] == "test"
    svc = mf.one(objects, "Service", "-controller")
    url = mf.container(pod, "readyz")["command"][3]
    assert url == f"http://{svc.name}.{NAMESPACE}.svc.cluster.local:{svc.obj['spec']['ports'][0]['port']}/readyz"


@pytest.mark.timeout(60)
def test_helm_test_script_fails_with_a_message_when_the_controller_is_unreachable(chart: helm.Chart) -> None:
    """Runs the test pod's own command here against a loopback port where nothing listens."""
    from elastic.testing.etcd_server import free_port

    values = by_name("auth") | {"tests": {"enabled": True, "timeoutSeconds": 3}}
    command = mf.container(mf.one(render(chart, values), "Pod"), "readyz")["command"]
    assert command[:2] == ["python3", "-c"] and command[4] == "3"
    url = f"http://127.0.0.1:{free_port()}/readyz"
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", command[2], url, "3"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1
    assert f"{url}: not ready:" in proc.stdout
    assert 3 <= time.monotonic() - started < 20


# --- bad values fail with the intended message ---------------------------------------------------------

_FAILS = [
    pytest.param({}, "etrain: storage is missing", id="default-values-without-storage"),
    pytest.param(
        {"agent": {"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}}},
        "etrain: agent.autoscaling.minReplicas (5) is greater than agent.autoscaling.maxReplicas (2)",
        id="min-nodes-above-max-nodes",
    ),
    pytest.param({"storage": {"type": "s3"}}, "etrain: storage.type=s3 needs storage.s3.bucket", id="s3-no-bucket"),
    pytest.param(
        {"storage": {"type": "s3", "s3": {"bucket": "ckpt"}}},
        "etrain: storage.type=s3 needs credentials",
        id="s3-no-credentials",
    ),
    pytest.param(
        {"storage": {"pvc": {"create": True}}},
        "etrain: storage.pvc.create=true needs storage.pvc.storageClassName",
        id="pvc-create-no-class",
    ),
    pytest.param(
        {"storage": {"pvc": {"create": True, "existingClaim": "x", "storageClassName": "lustre"}}},
        "etrain: storage.pvc.existingClaim and storage.pvc.create=true exclude each other",
        id="pvc-both",
    ),
    pytest.param({"etcd": {"replicas": 4}}, "etrain: etcd.replicas must be odd", id="even-etcd"),
    pytest.param(
        {"agent": {"kind": "DaemonSet", "autoscaling": {"enabled": True}}},
        "etrain: agent.autoscaling.enabled=true needs agent.kind=StatefulSet",
        id="autoscaled-daemonset",
    ),
    pytest.param(
        {"agent": {"kind": "DaemonSet", "rdzvHost": "dns"}},
        "etrain: agent.rdzvHost=dns needs agent.kind=StatefulSet",
        id="dns-daemonset",
    ),
    pytest.param(
        {"agent": {"hostNetwork": True, "rdzvHost": "dns"}},
        "etrain: agent.hostNetwork=true needs agent.rdzvHost=podIP",
        id="hostnetwork-dns",
    ),
    pytest.param(
        {"auth": {"existingSecret": "tok", "tokens": [{"name": "a", "role": "read", "token": "t" * 16}]}},
        "etrain: auth.existingSecret and auth.tokens exclude each other",
        id="auth-tokens-twice",
    ),
    pytest.param(
        {"auth": {"enabled": False}},
        "etrain: auth.enabled=false needs auth.allowInsecure=true",
        id="auth-off-unconfirmed",
    ),
    pytest.param(
        {"auth": {"enabled": False, "allowInsecure": True, "existingSecret": "tok"}},
        "etrain: auth.existingSecret or auth.tokens is set but auth.enabled=false",
        id="auth-off-with-tokens",
    ),
    pytest.param(
        {"etcd": {"tls": {"enabled": False}}},
        "etrain: etcd.tls.enabled=false needs etcd.tls.allowInsecure=true",
        id="etcd-plain-unconfirmed",
    ),
    pytest.param(
        {"etcd": {"tls": {"enabled": False, "allowInsecure": True, "existingSecret": "etcd-tls"}}},
        "etrain: etcd.tls.existingSecret, etcd.tls.existingClientSecret and etcd.tls.extraSANs need "
        "etcd.tls.enabled=true",
        id="etcd-plain-with-certificates",
    ),
    pytest.param(
        {"etcd": {"tls": {"existingClientSecret": "etcd-client"}}},
        "etrain: etcd.tls.existingClientSecret needs etcd.tls.existingSecret",
        id="etcd-client-cert-without-server-cert",
    ),
    pytest.param(
        {"etcd": {"tls": {"existingSecret": "etcd-tls", "extraSANs": ["127.0.0.1"]}}},
        "etrain: etcd.tls.extraSANs applies to the generated certificate only",
        id="etcd-extra-sans-with-own-certificate",
    ),
    pytest.param(
        {"etcd": {"external": {"endpoints": ["etcd:2379"]}, "tls": {"existingSecret": "etcd-tls"}}},
        "etrain: etcd.tls.* configures the in-cluster etcd, which etcd.external.endpoints replaces",
        id="etcd-tls-with-external-etcd",
    ),
    pytest.param(
        {"agent": {"hostNetwork": True}},
        "etrain: agent.hostNetwork=true with networkPolicy.enabled=true needs networkPolicy.nodeCIDRs",
        id="hostnetwork-without-node-cidrs",
    ),
    pytest.param(
        {"controller": {"service": {"type": "LoadBalancer"}}},
        "etrain: controller.service.type=LoadBalancer with networkPolicy.enabled=true needs "
        "networkPolicy.controller.extraFrom",
        id="loadbalancer-without-policy-peers",
    ),
    pytest.param(
        {"etcd": {"external": {"endpoints": ["etcd:2379"], "tls": {"enabled": True}}}},
        "etrain: etcd.external.tls.enabled=true needs etcd.external.tls.existingSecret",
        id="external-tls-no-secret",
    ),
    pytest.param(
        {"etcd": {"external": {"endpoints": ["etcd:2379"], "auth": {"username": "u"}}}},
        "etrain: etcd.external.auth.username needs etcd.external.auth.existingSecret",
        id="external-user-no-password",
    ),
]


@pytest.mark.parametrize(("overrides", "message"), _FAILS)
def test_bad_values_fail_with_the_intended_message(chart: helm.Chart, overrides: dict[str, Any], message: str) -> None:
    storage = {} if "storage" in overrides or not overrides else {"storage": {"pvc": {"existingClaim": "ckpt"}}}
    values = _merge(storage, overrides)
    chart.validate_schema(chart.merge_values(values))  # the schema accepts each of them: the chart logic rejects
    with pytest.raises(helm.HelmRenderError) as info:
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
    assert message in str(info.value)
    with helm.Config(namespace=NAMESPACE) as cfg, pytest.raises(helm.HelmError) as install_info:
        cfg.install(chart, RELEASE, values, dry_run="client")
    assert message in str(install_info.value)


_SCHEMA_FAILS = [
    pytest.param({"agent": {"replica": 3}}, "at '/agent': additional properties 'replica' not allowed", id="typo"),
    pytest.param({"storage": {"type": "nfs"}}, "at '/storage/type': value must be one of 'pvc', 's3'", id="storage"),
    pytest.param(
        {"auth": {"enabled": True, "tokens": [{"name": "x", "role": "root", "token": "t" * 20}]}},
        "at '/auth/tokens/0/role': value must be one of 'admin', 'user', 'read'",
        id="role",
    ),
    pytest.param({"agent": {"nprocPerNode": -1}}, "at '/agent/nprocPerNode': minimum: got -1, want 0", id="nproc"),
    pytest.param(
        {"agent": {"autoscaling": {"minReplicas": 0}}},
        "at '/agent/autoscaling/minReplicas': minimum: got 0, want 1",
        id="min-nodes-zero",
    ),
    pytest.param(
        {"etcd": {"external": {"endpoints": ["http://a b:2379"]}}},
        "at '/etcd/external/endpoints/0'",
        id="url",
    ),
    pytest.param({"controller": {"port": 70000}}, "at '/controller/port': maximum: got 70,000, want 65,535", id="port"),
    pytest.param(
        {"controller": {"quotas": {"users": {"alice": -1}}}},
        "at '/controller/quotas/users/alice': minimum: got -1, want 0",
        id="quota-negative",
    ),
    pytest.param(
        {"controller": {"quotas": {"user": {"alice": 1}}}},
        "at '/controller/quotas': additional properties 'user' not allowed",
        id="quota-typo",
    ),
]


@pytest.mark.parametrize(("overrides", "message"), _SCHEMA_FAILS)
def test_schema_rejects_bad_values_naming_the_key(chart: helm.Chart, overrides: dict[str, Any], message: str) -> None:
    values = _merge({"storage": {"pvc": {"existingClaim": "ckpt"}}}, overrides)
    with pytest.raises(helm.HelmValuesError) as info:
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
    assert message in str(info.value)
    report = helm.lint(CHART_DIR, values, strict=True)
    assert any(message in e for e in report["errors"]), report


def test_lint_does_not_evaluate_fail_so_render_must() -> None:
    """Helm's lint mode turns `fail` into a log line: it passes values the chart refuses to install. That
    is why every bad-values test above renders instead of relying on lint."""
    report = helm.lint(CHART_DIR, {"etcd": {"replicas": 4}}, strict=True)
    assert report["errors"] == []


# --- documentation of values ---------------------------------------------------------------------------


def test_schema_is_valid_draft7_and_accepts_the_defaults() -> None:
    schema = json.loads((CHART_DIR / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    defaults = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    assert list(jsonschema.Draft7Validator(schema).iter_errors(defaults)) == []


def test_every_values_key_is_documented_and_in_the_schema() -> None:
    schema = json.loads((CHART_DIR / "values.schema.json").read_text())
    lines = (CHART_DIR / "values.yaml").read_text().splitlines()
    stack: list[tuple[int, str, bool]] = []  # (indent, key, documented)
    undocumented: list[str] = []
    unknown: list[str] = []
    for index, line in enumerate(lines):
        match = re.match(r"^( *)([A-Za-z][\w.-]*):", line)
        if not match:
            continue
        indent = len(match.group(1))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = [key for _, key, _ in stack] + [match.group(2)]
        previous = next((ln.strip() for ln in reversed(lines[:index]) if ln.strip()), "")
        commented = previous.startswith("#")
        parent_commented = bool(stack) and stack[-1][2]
        stack.append((indent, match.group(2), commented))
        node = _schema_node(schema, path)
        parent = _schema_node(schema, path[:-1])
        if node is None:
            if parent is not None and parent.get("properties"):
                unknown.append(".".join(path))
            continue  # inside a free-form map (resources, securityContext, ...): example content
        if "properties" in node:
            continue  # a section header; its keys carry the documentation
        if not (commented or parent_commented):  # a key, or a group such as probe timings, has a comment
            undocumented.append(".".join(path))
        if not node.get("description"):
            undocumented.append(".".join(path) + " (schema)")
    assert undocumented == [] and unknown == []


def _schema_node(schema: dict[str, Any], path: list[str]) -> dict[str, Any] | None:
    node: dict[str, Any] | None = schema
    for key in path:
        if node is None or key not in node.get("properties", {}):
            return None
        node = node["properties"][key]
    return node


def _mounted_files(workload: mf.Manifest, container: dict[str, Any]) -> dict[str, str]:
    """File path in the container -> name of the Secret it comes from."""
    volumes = {v["name"]: v for v in mf.pod_spec(workload)["volumes"]}
    out: dict[str, str] = {}
    for mount in container["volumeMounts"]:
        secret = volumes[mount["name"]].get("secret")
        if secret:
            for item in secret["items"]:
                out[f"{mount['mountPath']}/{item['path']}"] = secret["secretName"]
    return out


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


# --- the rendered commands start the real service --------------------------------------------------------


def _service_cli_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("service.cli") is not None


@pytest.mark.timeout(90)
@pytest.mark.skipif(not _service_cli_available(), reason="the service CLI (service/cli/main.py) is not in this tree")
def test_rendered_controller_command_serves_readyz_for_the_helm_test_script(chart: helm.Chart, tmp_path: Path) -> None:
    """The controller container's command and env, as rendered, start the real controller against the
    rendered etcd (mutual TLS, certificates from the rendered Secrets, tokens file from the auth Secret);
    the `helm test` pod's script then passes against it."""
    from elastic.testing.etcd_server import free_port

    objects = render(chart, by_name("auth") | {"etcd": {"replicas": 1, "tls": {"extraSANs": ["127.0.0.1"]}}})
    etcd = rd.RenderedEtcd(objects, tmp_path / "etcd").start()
    rd.run_etcd_bootstrap(objects, etcd, tmp_path)  # the controller pod's init container: etcd's users
    port = free_port()
    deploy = mf.one(objects, "Deployment")
    overrides = {"ETRAIN_HOST": "127.0.0.1", "ETRAIN_PORT": str(port)}
    proc = rd.etrain_process(objects, deploy, "controller", etcd, tmp_path, overrides)
    try:
        script = mf.container(mf.one(objects, "Pod"), "readyz")["command"][2]
        check = subprocess.run(
            [sys.executable, "-c", script, f"http://127.0.0.1:{port}/readyz", "45"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert check.returncode == 0, (check.stdout, proc.poll(), (tmp_path / "controller.log").read_text())
        assert "HTTP 200" in check.stdout
    finally:
        rd.stop(proc, 15)
        etcd.stop()


@pytest.mark.timeout(90)
@pytest.mark.skipif(not _service_cli_available(), reason="the service CLI (service/cli/main.py) is not in this tree")
def test_rendered_agent_command_starts_an_agent_that_answers_healthz(chart: helm.Chart, tmp_path: Path) -> None:
    """The agent container's command and env (downward-API fields and `$(VAR)` expanded as the kubelet
    does) start the real agent against the rendered etcd (mutual TLS), and its health port answers."""
    from elastic.testing.etcd_server import free_port

    objects = render(chart, by_name("s3") | {"etcd": {"replicas": 1, "tls": {"extraSANs": ["127.0.0.1"]}}})
    etcd = rd.RenderedEtcd(objects, tmp_path / "etcd").start()
    agents = mf.one(objects, "StatefulSet", "-agent")
    port = free_port()
    fields = {"metadata.name": "demo-etrain-agent-0", "status.podIP": "127.0.0.1", "spec.nodeName": "node-a"}
    overrides = {
        "ETRAIN_PREFIX": f"/deploy-test/{port}",
        "ETRAIN_HEALTH_PORT": str(port),
        "ETRAIN_WORK_DIR": str(tmp_path / "work"),
    }
    # the controller pod's init container: etcd's users; the agents' user gets the (overridden) prefix's keys
    rd.run_etcd_bootstrap(objects, etcd, tmp_path, {"ETRAIN_PREFIX": overrides["ETRAIN_PREFIX"]})
    env = rd.expand_env(mf.container(agents, "agent")["env"], overrides, fields)
    assert env["ETRAIN_NODE_NAME"] == "demo-etrain-agent-0" and env["ETRAIN_RDZV_HOST"] == "127.0.0.1"
    proc = rd.etrain_process(objects, agents, "agent", etcd, tmp_path, overrides, fields)
    try:
        script = mf.container(mf.one(objects, "Pod"), "readyz")["command"][2]
        check = subprocess.run(
            [sys.executable, "-c", script, f"http://127.0.0.1:{port}/healthz", "45"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert check.returncode == 0, (check.stdout, proc.poll(), (tmp_path / "agent.log").read_text())
    finally:
        rd.stop(proc, 30)
        etcd.stop()
