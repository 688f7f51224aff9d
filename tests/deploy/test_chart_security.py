"""The chart is secure by default: API tokens on (generated when none are given), the in-cluster etcd on
mutual TLS with chart-made certificates, NetworkPolicies around etcd, the controller and the agents; each
opt-out is explicit. The decisive check runs the rendered etcd members (TLS flags and certificates as
rendered) on loopback: a client without a certificate is refused, the rendered controller connects."""

from __future__ import annotations

import base64
import importlib.util
import ipaddress
import json
import threading
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml

from tests.deploy import manifests as mf
from tests.deploy import rendered as rd
from tests.deploy.conftest import NAMESPACE, RELEASE

pytestmark = pytest.mark.timeout(120)

STORAGE = {"storage": {"pvc": {"existingClaim": "ckpt"}}}
LOOPBACK_SANS = {"etcd": {"tls": {"extraSANs": ["127.0.0.1"]}}}


def render(chart: helm.Chart, *overrides: dict[str, Any]) -> list[mf.Manifest]:
    values: dict[str, Any] = dict(STORAGE)
    for o in overrides:
        values = _merge(values, o)
    return mf.split(chart.render(values, name=RELEASE, namespace=NAMESPACE))


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in override.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _controller(objects: list[mf.Manifest]) -> dict[str, Any]:
    return mf.container(mf.one(objects, "Deployment", "-controller"), "controller")


# --- API tokens ------------------------------------------------------------------------------------------


def test_defaults_require_api_tokens_and_generate_an_admin_and_a_read_token(chart: helm.Chart) -> None:
    objects = render(chart)
    secret = mf.one(objects, "Secret", "-auth")
    assert secret.obj["metadata"]["annotations"]["etrain.io/generated-tokens"] == "true"
    data = rd.secret_data(objects, secret.name)
    tokens = yaml.safe_load(data["tokens.yaml"])["tokens"]
    assert [(t["name"], t["role"]) for t in tokens] == [("admin", "admin"), ("read", "read")]
    admin, read = (t["token"] for t in tokens)
    assert admin.isalnum() and read.isalnum() and len(admin) == len(read) == 40 and admin != read
    assert (data["admin-token"].decode(), data["read-token"].decode()) == (admin, read)
    c = _controller(objects)
    files = rd.mounted_secret_keys(mf.one(objects, "Deployment"), c)
    assert files[mf.env_of(c)["ETRAIN_TOKENS_FILE"]][:2] == (secret.name, "tokens.yaml")
    # another render without a cluster (lookup finds nothing) draws new tokens
    again = yaml.safe_load(rd.secret_data(render(chart), secret.name)["tokens.yaml"])["tokens"]
    assert again[0]["token"] != admin


def test_given_tokens_or_an_existing_secret_replace_the_generated_ones(chart: helm.Chart) -> None:
    given = [{"name": "ci", "role": "admin", "token": "ci-admin-token-0123456789"}]
    objects = render(chart, {"auth": {"tokens": given}})
    secret = mf.one(objects, "Secret", "-auth")
    assert "annotations" not in secret.obj["metadata"]
    assert yaml.safe_load(rd.secret_data(objects, secret.name)["tokens.yaml"]) == {"tokens": given}
    objects = render(chart, {"auth": {"existingSecret": "team-tokens"}})
    assert mf.find(objects, "Secret", "-auth") == []
    volumes = {v["name"]: v for v in mf.pod_spec(mf.one(objects, "Deployment"))["volumes"]}
    assert volumes["auth"]["secret"]["secretName"] == "team-tokens"
    pod_meta = mf.one(objects, "Deployment").obj["spec"]["template"]["metadata"]
    assert "checksum/auth" not in (pod_meta.get("annotations") or {})


# --- etcd TLS --------------------------------------------------------------------------------------------


def test_defaults_run_etcd_with_mutual_tls_and_a_certificate_for_every_member(chart: helm.Chart) -> None:
    x509 = pytest.importorskip("cryptography.x509")
    objects = render(chart, {"etcd": {"replicas": 5}})
    sts = mf.one(objects, "StatefulSet", "-etcd")
    args = mf.container(sts, "etcd")["args"]
    for flag in (
        "--cert-file=/etc/etcd/tls/tls.crt",
        "--key-file=/etc/etcd/tls/tls.key",
        "--trusted-ca-file=/etc/etcd/tls/ca.crt",
        "--client-cert-auth",
        "--peer-cert-file=/etc/etcd/tls/tls.crt",
        "--peer-key-file=/etc/etcd/tls/tls.key",
        "--peer-trusted-ca-file=/etc/etcd/tls/ca.crt",
        "--peer-client-cert-auth",
    ):
        assert flag in args
    urls = [a for a in args if a.startswith(("--listen-client", "--advertise", "--listen-peer", "--initial-adv"))]
    assert len(urls) == 4 and all("=https://" in a for a in urls)
    server = rd.secret_data(objects, f"{RELEASE}-etrain-etcd-server-tls")
    cert = x509.load_pem_x509_certificate(server["tls.crt"])
    ca = x509.load_pem_x509_certificate(server["ca.crt"])
    cert.verify_directly_issued_by(ca)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    names = set(sans.get_values_for_type(x509.DNSName))
    headless = sts.obj["spec"]["serviceName"]
    members = {f"{sts.name}-{i}.{headless}.{NAMESPACE}.svc.cluster.local" for i in range(5)}
    client_service = mf.one(objects, "Service", "-etcd").name
    assert members | {client_service, f"{client_service}.{NAMESPACE}.svc.cluster.local"} <= names
    usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert {u.dotted_string for u in usages} >= {"1.3.6.1.5.5.7.3.1", "1.3.6.1.5.5.7.3.2"}  # server, client (peers)
    # the controller and agents present a client certificate from the same CA, and never see the server key
    client = rd.secret_data(objects, f"{RELEASE}-etrain-etcd-client-tls")
    x509.load_pem_x509_certificate(client["tls.crt"]).verify_directly_issued_by(ca)
    assert client["ca.crt"] == server["ca.crt"]
    workloads = ((mf.one(objects, "Deployment"), "controller"), (mf.one(objects, "StatefulSet", "-agent"), "agent"))
    for workload, name in workloads:
        c = mf.container(workload, name)
        env = mf.env_of(c)
        files = rd.mounted_secret_keys(workload, c)
        client_secret = f"{RELEASE}-etrain-etcd-client-tls"
        assert files[env["ETRAIN_ETCD_CA_CERT"]][:2] == (client_secret, "ca.crt")
        assert files[env["ETRAIN_ETCD_CERT"]][:2] == (client_secret, "tls.crt")
        assert files[env["ETRAIN_ETCD_KEY"]][:2] == (client_secret, "tls.key")
        tokens = {f"{RELEASE}-etrain-auth"} if name == "controller" else set()
        users = f"{RELEASE}-etrain-etcd-users"
        assert {secret for secret, _, _ in files.values()} == {client_secret, users} | tokens
        # etcd users (etcd.auth): the controller is root; an agent holds its own user's password, never root's
        etcd_keys = {key for secret, key, _ in files.values() if secret == users}
        if name == "controller":
            assert env["ETRAIN_ETCD_USER"] == "root" and etcd_keys == {"root-password", "agent-password"}
            assert files[env["ETRAIN_ETCD_PASSWORD_FILE"]][:2] == (users, "root-password")
        else:
            assert env["ETRAIN_ETCD_USER"] == "etrain-agent" and etcd_keys == {"agent-password"}
            assert env["ETRAIN_ETCD_CONNECT_TIMEOUT"] == "90"  # waits for the controller's bootstrap
            assert files[env["ETRAIN_ETCD_PASSWORD_FILE"]][:2] == (users, "agent-password")
        assert all(e.startswith("https://") for e in env["ETRAIN_ETCD_ENDPOINTS"].split(","))
    role = mf.one(objects, "Role")
    assert role.obj["rules"][0]["resourceNames"] == [f"{RELEASE}-etrain-auth", f"{RELEASE}-etrain-etcd-client-tls"]
    # probes use the plain-HTTP metrics listener: the kubelet has no client certificate
    etcd = mf.container(sts, "etcd")
    assert etcd["readinessProbe"]["httpGet"] == {"path": "/health", "port": "metrics"}
    assert "--listen-metrics-urls=http://0.0.0.0:2381" in args


def test_extra_sans_reach_the_generated_certificate(chart: helm.Chart) -> None:
    x509 = pytest.importorskip("cryptography.x509")
    objects = render(chart, {"etcd": {"tls": {"extraSANs": ["127.0.0.1", "etcd.example.org"]}}})
    cert = x509.load_pem_x509_certificate(rd.secret_data(objects, f"{RELEASE}-etrain-etcd-server-tls")["tls.crt"])
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    assert "etcd.example.org" in sans.get_values_for_type(x509.DNSName)


def test_existing_tls_secrets_replace_the_generated_certificates(chart: helm.Chart) -> None:
    objects = render(chart, {"etcd": {"tls": {"existingSecret": "etcd-server", "existingClientSecret": "etcd-client"}}})
    assert [m.name for m in objects if m.kind == "Secret" and "etcd" in m.name] == [f"{RELEASE}-etrain-etcd-users"]
    volumes = {v["name"]: v for v in mf.pod_spec(mf.one(objects, "StatefulSet", "-etcd"))["volumes"]}
    assert volumes["tls"]["secret"]["secretName"] == "etcd-server"
    volumes = {v["name"]: v for v in mf.pod_spec(mf.one(objects, "Deployment"))["volumes"]}
    assert volumes["etcd-tls"]["secret"]["secretName"] == "etcd-client"
    # one Secret for both: the members' certificate doubles as the client certificate
    objects = render(chart, {"etcd": {"tls": {"existingSecret": "etcd-server"}}})
    volumes = {v["name"]: v for v in mf.pod_spec(mf.one(objects, "StatefulSet", "-agent"))["volumes"]}
    assert volumes["etcd-tls"]["secret"]["secretName"] == "etcd-server"


def test_explicit_opt_outs_render_the_insecure_setup_and_say_so(chart: helm.Chart) -> None:
    values = {
        "auth": {"enabled": False, "allowInsecure": True},
        "etcd": {"tls": {"enabled": False, "allowInsecure": True}},
        "networkPolicy": {"enabled": False},
    }
    objects = render(chart, values)
    assert mf.find(objects, "Secret") == [] and mf.find(objects, "NetworkPolicy") == []
    env = mf.env_of(_controller(objects))
    assert not {"ETRAIN_TOKENS_FILE", "ETRAIN_ETCD_CA_CERT", "ETRAIN_ETCD_CERT", "ETRAIN_ETCD_KEY"} & set(env)
    assert all(e.startswith("http://") for e in env["ETRAIN_ETCD_ENDPOINTS"].split(","))
    assert env["ETRAIN_INSECURE"] == "1"  # the controller refuses an open API on 0.0.0.0 otherwise
    args = mf.container(mf.one(objects, "StatefulSet", "-etcd"), "etcd")["args"]
    assert not [a for a in args if "https" in a or a.startswith(("--cert", "--key", "--trusted", "--peer", "--client"))]
    notes = chart.render(_merge(STORAGE, values), name=RELEASE, namespace=NAMESPACE)["etrain/templates/NOTES.txt"]
    assert "WARNING: authentication is off" in notes and "WARNING: etcd speaks plain HTTP" in notes


def test_notes_say_how_to_read_the_generated_admin_token(chart: helm.Chart) -> None:
    notes = chart.render(STORAGE, name=RELEASE, namespace=NAMESPACE)["etrain/templates/NOTES.txt"]
    expected = (
        f"kubectl -n {NAMESPACE} get secret {RELEASE}-etrain-auth -o jsonpath='{{.data.admin-token}}' | base64 -d"
    )
    assert expected in notes


# --- NetworkPolicies -------------------------------------------------------------------------------------


class _Pod:
    def __init__(self, what: str, labels: dict[str, str], namespace: str = NAMESPACE) -> None:
        self.what, self.labels, self.namespace = what, labels, namespace
        self.namespace_labels = {"kubernetes.io/metadata.name": namespace}


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, selector  # the chart uses matchLabels only
    return all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())


def _peer_admits(peer: dict[str, Any], source: _Pod, policy_namespace: str) -> bool:
    if "ipBlock" in peer:
        return False  # the sources here are pods with pod IPs outside any node CIDR
    if "namespaceSelector" in peer:
        if not _selects(peer["namespaceSelector"], source.namespace_labels):
            return False
    elif source.namespace != policy_namespace:
        return False  # a podSelector alone selects pods of the policy's own namespace
    return _selects(peer.get("podSelector", {}), source.labels)


def _admitted(objects: list[mf.Manifest], source: _Pod, target: mf.Manifest, port: str | int) -> bool:
    """Kubernetes NetworkPolicy ingress semantics: a pod selected by no policy accepts everything;
    otherwise a connection needs one rule whose `from` admits the source and whose `ports` hold the port."""
    labels = mf.pod_labels(target)
    numbers = {p["name"]: p["containerPort"] for c in mf.pod_spec(target)["containers"] for p in c.get("ports", [])}
    number = numbers.get(port, port) if isinstance(port, str) else port
    policies = [p for p in mf.find(objects, "NetworkPolicy") if _selects(p.obj["spec"]["podSelector"], labels)]
    if not policies:
        return True

    def holds(p: dict[str, Any]) -> bool:  # a NetworkPolicyPort: a TCP connection to ``number``
        if p.get("protocol", "TCP") != "TCP":
            return False
        if "port" not in p:
            return True  # every port of the protocol
        first = numbers.get(p["port"], p["port"])
        return first == number if "endPort" not in p else first <= number <= p["endPort"]

    for policy in policies:
        assert policy.obj["spec"]["policyTypes"] == ["Ingress"]
        for rule in policy.obj["spec"].get("ingress", []):
            ports = rule.get("ports")
            if ports is not None and not any(holds(p) for p in ports):
                continue
            peers = rule.get("from")
            if peers is None or any(_peer_admits(p, source, policy.obj["metadata"]["namespace"]) for p in peers):
                return True
    return False


def test_network_policies_admit_only_controller_and_agents_to_etcd_and_agents_to_each_other(
    chart: helm.Chart,
) -> None:
    objects = render(chart, {"controller": {"ingress": {"enabled": True}}})
    etcd = mf.one(objects, "StatefulSet", "-etcd")
    controller = mf.one(objects, "Deployment")
    agents = mf.one(objects, "StatefulSet", "-agent")
    own = [_Pod(what, mf.pod_labels(m)) for what, m in (("controller", controller), ("agent", agents), ("etcd", etcd))]
    test_pod = _Pod("helm test pod", mf.pod_labels(mf.one(objects, "Pod")))
    stranger = _Pod("other pod of the namespace", {"app": "debug"})
    ingress = _Pod("ingress controller", {"app.kubernetes.io/name": "ingress-nginx"}, "ingress-nginx")
    impostor = _Pod("agent-labelled pod elsewhere", mf.pod_labels(agents), "sandbox")
    sources = [*own, test_pod, stranger, ingress, impostor]

    def who(target: mf.Manifest, port: str | int) -> set[str]:
        return {s.what for s in sources if _admitted(objects, s, target, port)}

    assert who(etcd, "client") == {"controller", "agent"}
    assert who(etcd, "peer") == {"etcd"}
    everyone_here = {"controller", "agent", "etcd", "helm test pod", "other pod of the namespace"}
    assert who(controller, "http") == everyone_here | {"ingress controller"}
    assert who(agents, "health") == who(agents, 29500) == who(agents, 45123) == {"agent"}
    assert who(agents, 8081) == who(agents, 8083) == who(agents, 1) == who(agents, 65535) == {"agent"}
    assert who(agents, "logs") == {"controller"}  # the controller proxies the jobs' logs; no job's worker reads them
    # without the namespace-wide rule and the ingress, only the `helm test` pod (and extraFrom) remain
    monitoring = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    objects = render(chart, {"networkPolicy": {"controller": {"allowNamespace": False, "extraFrom": [monitoring]}}})
    prometheus = _Pod("prometheus", {"app": "prometheus"}, "monitoring")
    sources = [*own, test_pod, stranger, ingress, prometheus]
    assert who(mf.one(objects, "Deployment"), "http") == {"helm test pod", "prometheus"}


def test_host_network_agents_reach_etcd_and_each_other_from_the_node_cidrs(chart: helm.Chart) -> None:
    objects = render(chart, {"agent": {"hostNetwork": True}, "networkPolicy": {"nodeCIDRs": ["10.0.0.0/16"]}})
    for suffix, port in (("-etcd", "client"), ("-agent", None)):
        policy = mf.one(objects, "NetworkPolicy", suffix)
        rules = [r for r in policy.obj["spec"]["ingress"] if port is None or r["ports"][0]["port"] == port]
        assert {"ipBlock": {"cidr": "10.0.0.0/16"}} in rules[0]["from"]


# --- the rendered etcd, run ------------------------------------------------------------------------------

needs_cli = pytest.mark.skipif(
    importlib.util.find_spec("service.cli") is None, reason="the service CLI (service/cli/main.py) is not in this tree"
)


@pytest.mark.timeout(150)
@needs_cli
def test_rendered_etcd_refuses_clients_without_a_certificate_and_the_rendered_controller_connects(
    chart: helm.Chart, tmp_path: Path
) -> None:
    """Three members with the rendered arguments (peer TLS included) and the rendered Secret's PEMs."""
    from elastic.etcd import EtcdConfig, EtcdError, create_client
    from elastic.testing.etcd_server import free_port
    from service.client import ApiClient, ApiError
    from tests.integration.service_harness import wait_api

    objects = render(chart, LOOPBACK_SANS)
    etcd = rd.RenderedEtcd(objects, tmp_path / "etcd").start()
    try:
        deploy = mf.one(objects, "Deployment")
        env = rd.expand_env(_controller(objects)["env"], {}, {})
        endpoints = etcd.localize(env["ETRAIN_ETCD_ENDPOINTS"])
        assert endpoints.count("https://127.0.0.1:") == 3
        files = rd.write_mounted_secrets(objects, deploy, _controller(objects), tmp_path / "client")
        ca = files[env["ETRAIN_ETCD_CA_CERT"]]

        # no client certificate: the TLS handshake is refused; plain HTTP is refused as well
        for options in ({"ca_cert": ca}, {}):
            plain = endpoints.replace("https://", "") if not options else endpoints
            client = create_client(EtcdConfig.from_options(plain, {**options, "op_timeout": "2"}))
            try:
                with pytest.raises(EtcdError):
                    client.put("/etrain/assign/node-a/planted", b"run me")
            finally:
                client.close()
        logs = etcd.logs()
        assert "client didn't provide a certificate" in logs  # refused by --client-cert-auth
        assert "first record does not look like a TLS handshake" in logs  # plain HTTP refused
        # the rendered controller without its client certificate stops with one line (exit 2) ...
        no_cert = {"ETRAIN_ETCD_CERT": "", "ETRAIN_ETCD_KEY": "", "ETRAIN_ETCD_CONNECT_TIMEOUT": "3"}
        log = tmp_path / "refused.log"
        proc = rd.etrain_process(objects, deploy, "controller", etcd, tmp_path, no_cert, log=log)
        assert proc.wait(timeout=60) == 2, log.read_text()

        # the init container makes etcd's users and turns authentication on: a client certificate alone (the
        # one jobs hold too) reads nothing now; the controller is root, the agents their own user
        assert "etcd authentication enabled" in rd.run_etcd_bootstrap(objects, etcd, tmp_path)
        cert = {"ca_cert": ca, "cert": files[env["ETRAIN_ETCD_CERT"]], "cert_key": files[env["ETRAIN_ETCD_KEY"]]}
        cert_only = create_client(EtcdConfig.from_options(endpoints, {**cert, "op_timeout": "2"}))
        try:
            with pytest.raises(EtcdError):
                cert_only.get("/etrain/jobs/planted")
        finally:
            cert_only.close()

        # ... and with the rendered env (client certificate, root's password, generated tokens) it serves the API
        port = free_port()
        proc = rd.etrain_process(
            objects, deploy, "controller", etcd, tmp_path, {"ETRAIN_HOST": "127.0.0.1", "ETRAIN_PORT": str(port)}
        )
        try:
            url = f"http://127.0.0.1:{port}"
            wait_api("the controller", ApiClient(url).ready, 60)
            tokens = rd.secret_data(objects, f"{RELEASE}-etrain-auth")
            assert ApiClient(url, tokens["read-token"].decode()).jobs() == []
            with pytest.raises(ApiError) as refused:
                ApiClient(url).jobs()
            assert refused.value.status == 401
        finally:
            rd.stop(proc, 15)
    finally:
        etcd.stop()


@needs_cli
def test_rendered_opt_outs_run_plain_etcd_and_an_open_controller(chart: helm.Chart, tmp_path: Path) -> None:
    """The documented opt-outs (auth and etcd TLS off, both confirmed) render members that serve plain
    HTTP and a controller that starts on the rendered all-interfaces address without tokens."""
    from elastic.etcd import EtcdConfig, create_client
    from elastic.testing.etcd_server import free_port
    from service.client import ApiClient
    from tests.integration.service_harness import wait_api

    no_auth = {"auth": {"enabled": False, "allowInsecure": True}}
    plain_etcd = {"etcd": {"replicas": 1, "tls": {"enabled": False, "allowInsecure": True}}}
    objects = render(chart, no_auth, plain_etcd)
    etcd = rd.RenderedEtcd(objects, tmp_path / "etcd").start()
    try:
        endpoints = etcd.localize(rd.expand_env(_controller(objects)["env"], {}, {})["ETRAIN_ETCD_ENDPOINTS"])
        assert endpoints.startswith("http://127.0.0.1:")
        client = create_client(EtcdConfig.from_options(endpoints, {"op_timeout": "5"}))
        try:
            client.ping()
        finally:
            client.close()
        port = free_port()
        deploy = mf.one(objects, "Deployment")
        proc = rd.etrain_process(objects, deploy, "controller", etcd, tmp_path, {"ETRAIN_PORT": str(port)})
        try:
            assert rd.expand_env(_controller(objects)["env"], {}, {})["ETRAIN_HOST"] == "0.0.0.0"
            api = ApiClient(f"http://127.0.0.1:{port}")
            wait_api("the controller", api.ready, 60)
            assert api.jobs() == []  # no token needed
        finally:
            rd.stop(proc, 15)
    finally:
        etcd.stop()


# --- helm upgrade keeps what the chart generated ----------------------------------------------------------


class _SecretStore(BaseHTTPRequestHandler):
    """The part of a Kubernetes API server that Helm's `lookup` of a Secret uses: discovery of the core
    group and GET of Secrets by name, answered from ``secrets`` (404 otherwise)."""

    secrets: dict[str, dict[str, Any]] = {}

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        path = self.path.split("?")[0]
        prefix = f"/api/v1/namespaces/{NAMESPACE}/secrets/"
        body: dict[str, Any] | None = None
        if path == "/api/v1":
            secrets = {"name": "secrets", "singularName": "secret", "namespaced": True, "kind": "Secret"}
            body = {"kind": "APIResourceList", "groupVersion": "v1", "resources": [{**secrets, "verbs": ["get"]}]}
        elif path.startswith(prefix):
            body = self.secrets.get(path[len(prefix) :])
        data = json.dumps(body or {"kind": "Status", "apiVersion": "v1", "code": 404, "reason": "NotFound"})
        self.send_response(200 if body else 404)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(data.encode())


def _stored(m: mf.Manifest) -> dict[str, Any]:
    """A rendered Secret as the API server returns it: stringData folded into base64 data."""
    obj = json.loads(json.dumps(m.obj))
    data = obj.setdefault("data", {})
    for key, value in obj.pop("stringData", {}).items():
        data[key] = base64.b64encode(str(value).encode()).decode()
    return obj


def test_helm_upgrade_keeps_generated_tokens_certificates_and_etcd_passwords(chart: helm.Chart) -> None:
    """Install, then upgrade against a loopback API server holding the installed Secrets: `lookup` finds
    them, so tokens, CA and certificates stay (and the controller's checksum, so no restart); changing the
    certificate's names re-signs only the server certificate, with the same CA."""
    x509 = pytest.importorskip("cryptography.x509")
    store = type("Store", (_SecretStore,), {"secrets": {}})
    server = ThreadingHTTPServer(("127.0.0.1", 0), store)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    kubeconfig = yaml.safe_dump(
        {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "c", "cluster": {"server": f"http://127.0.0.1:{server.server_port}"}}],
            "users": [{"name": "u", "user": {"token": "t"}}],
            "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u", "namespace": NAMESPACE}}],
            "current-context": "c",
        }
    )
    try:
        with helm.Config(namespace=NAMESPACE, kubeconfig_content=kubeconfig) as cfg:

            def release(values: dict[str, Any], **kind: bool) -> list[mf.Manifest]:
                rendered = cfg.render(chart, _merge(STORAGE, values), name=RELEASE, namespace=NAMESPACE, **kind)
                return mf.split(rendered)

            installed = release({}, is_install=True)
            store.secrets.update({m.name: _stored(m) for m in mf.find(installed, "Secret")})
            upgraded = release({}, is_upgrade=True)
            renamed = release({"etcd": {"tls": {"extraSANs": ["etcd.example.org"]}}}, is_upgrade=True)
    finally:
        server.shutdown()

    def keys(objects: list[mf.Manifest], suffix: str) -> dict[str, bytes]:
        return rd.secret_data(objects, mf.one(objects, "Secret", suffix).name)

    def checksum(objects: list[mf.Manifest]) -> str:
        return str(mf.one(objects, "Deployment").obj["spec"]["template"]["metadata"]["annotations"]["checksum/auth"])

    assert keys(upgraded, "-auth") == keys(installed, "-auth")
    assert checksum(upgraded) == checksum(installed)
    assert keys(upgraded, "-etcd-server-tls") == keys(installed, "-etcd-server-tls")
    assert keys(upgraded, "-etcd-client-tls") == keys(installed, "-etcd-client-tls")
    old, new = keys(installed, "-etcd-server-tls"), keys(renamed, "-etcd-server-tls")
    assert (new["ca.crt"], new["ca.key"]) == (old["ca.crt"], old["ca.key"]) and new["tls.crt"] != old["tls.crt"]
    cert = x509.load_pem_x509_certificate(new["tls.crt"])
    cert.verify_directly_issued_by(x509.load_pem_x509_certificate(old["ca.crt"]))
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "etcd.example.org" in sans.get_values_for_type(x509.DNSName)
    assert keys(renamed, "-etcd-client-tls") == keys(installed, "-etcd-client-tls")
    # etcd keeps its users in its data: their passwords must outlive upgrades (and differ from each other)
    users = keys(installed, "-etcd-users")
    assert keys(upgraded, "-etcd-users") == users and len(users["root-password"]) >= 32
    assert users["root-password"] != users["agent-password"]


def test_agents_run_each_job_as_a_uid_of_its_own_as_root_with_four_capabilities_and_root_only_secrets(
    chart: helm.Chart,
) -> None:
    objects = render(chart, {})
    agents = mf.one(objects, "StatefulSet", "-agent")
    agent = mf.container(agents, "agent")
    psc = mf.pod_spec(agents)["securityContext"]
    assert (psc["runAsUser"], psc["runAsGroup"], psc["runAsNonRoot"]) == (0, 0, False)
    assert psc["seccompProfile"] == {"type": "RuntimeDefault"}
    csc = agent["securityContext"]
    assert csc["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN", "KILL", "SETGID", "SETUID"]}
    assert csc["allowPrivilegeEscalation"] is False and csc["readOnlyRootFilesystem"] is True
    assert mf.env_of(agent)["ETRAIN_JOB_UID_RANGE"] == "20000-29999"
    files = rd.mounted_secret_keys(agents, agent)
    assert files and {mode for _, _, mode in files.values()} == {0o400}  # the client key: root's only
    controller = _controller(objects)
    assert {mode for _, _, mode in rd.mounted_secret_keys(mf.one(objects, "Deployment"), controller).values()} == {
        0o440
    }  # the controller runs as 10001 (the pods' fsGroup) and runs no job
    shared = render(chart, {"agent": {"jobIsolation": {"enabled": False}}})
    agents = mf.one(shared, "StatefulSet", "-agent")
    agent = mf.container(agents, "agent")
    assert mf.pod_spec(agents)["securityContext"]["runAsUser"] == 10001
    assert "add" not in agent["securityContext"]["capabilities"] and "ETRAIN_JOB_UID_RANGE" not in mf.env_of(agent)
    assert {mode for _, _, mode in rd.mounted_secret_keys(agents, agent).values()} == {0o440}


def test_in_cluster_etcd_users_follow_etcd_auth_and_tls_and_the_agents_user_cannot_be_root(chart: helm.Chart) -> None:
    """etcd.auth on (the default) gives the controller pod the bootstrap init container; off, or without TLS (no
    password crosses plain gRPC), nothing of it renders; root as the agents' user is refused with the key named."""

    def bootstrap(objects: list[mf.Manifest]) -> list[str]:
        return [c["name"] for c in mf.pod_spec(mf.one(objects, "Deployment")).get("initContainers", [])]

    on = render(chart)
    assert bootstrap(on) == ["etcd-bootstrap"]
    init = mf.env_of(mf.container(mf.one(on, "Deployment"), "etcd-bootstrap"))
    assert init["ETRAIN_ETCD_USER"] == "root" and init["ETRAIN_ETCD_AGENT_USER"] == "etrain-agent"
    assert not {k for k in init if k.startswith("AWS_")}  # the bootstrap gets etcd's settings only
    plain = {"etcd": {"tls": {"enabled": False, "allowInsecure": True}}}
    for objects in (render(chart, {"etcd": {"auth": {"enabled": False}}}), render(chart, plain)):
        assert bootstrap(objects) == []
        assert not [m for m in objects if m.kind == "Secret" and m.name.endswith("-etcd-users")]
        pods = ((mf.one(objects, "Deployment"), "controller"), (mf.one(objects, "StatefulSet", "-agent"), "agent"))
        for workload, name in pods:
            assert "ETRAIN_ETCD_USER" not in mf.env_of(mf.container(workload, name))
    with pytest.raises(helm.HelmRenderError) as info:
        render(chart, {"etcd": {"auth": {"agentUser": "root"}}})
    assert "etcd.auth.agentUser must be a user name other than root" in str(info.value)
    existing = render(chart, {"etcd": {"auth": {"existingSecret": "my-etcd-users"}}})
    assert not [m for m in existing if m.kind == "Secret" and m.name.endswith("-etcd-users")]
    volumes = {v["name"]: v for v in mf.pod_spec(mf.one(existing, "StatefulSet", "-agent"))["volumes"]}
    assert volumes["etcd-auth"]["secret"]["secretName"] == "my-etcd-users"


def test_per_node_etcd_users_give_each_agent_a_user_and_secret_of_its_own_and_the_rendered_bootstrap_confines_them(
    chart: helm.Chart, tmp_path: Path
) -> None:
    """etcd.auth.perNodeUsers: agent.replicas StatefulSets of one pod, each mounting only its own password Secret;
    the rendered init container (its args, its projected volume of every agent's password) makes one etcd user per
    agent on the rendered etcd, and agent 1's user, with agent 1's mounted password, reaches node 1's keys only.
    Before, every agent held the one shared user, which reads every job's secrets (issue H3)."""
    from elastic.etcd import EtcdConfig, EtcdError, create_client

    objects = render(chart, LOOPBACK_SANS, {"etcd": {"auth": {"perNodeUsers": True}}, "agent": {"replicas": 3}})
    agents = [m for m in objects if m.kind == "StatefulSet" and "-agent" in m.name]
    assert [a.name for a in agents] == [f"{RELEASE}-etrain-agent-{i}" for i in range(3)]
    secrets = {}
    for i, sts in enumerate(agents):
        assert sts.obj["spec"]["replicas"] == 1
        env = mf.env_of(mf.container(sts, "agent"))
        assert env["ETRAIN_NODE_NAME"] == sts.name and env["ETRAIN_ETCD_USER"] == f"etrain-node-{sts.name}"
        mounted = rd.mounted_secret_keys(sts, mf.container(sts, "agent"))
        assert mounted["/etc/etrain/etcd-auth/password"][:2] == (f"{RELEASE}-etrain-etcd-node-{i}", "password")
        assert not [s for s, _, _ in mounted.values() if s.endswith("-etcd-users")]  # no shared password
        secrets[sts.name] = rd.secret_data(objects, f"{RELEASE}-etrain-etcd-node-{i}")["password"].decode()
    assert len(set(secrets.values())) == 3
    init = mf.container(mf.one(objects, "Deployment"), "etcd-bootstrap")
    assert "ETRAIN_ETCD_AGENT_PASSWORD_FILE" not in mf.env_of(init) and "--prune-nodes" in init["args"]

    etcd = rd.RenderedEtcd(objects, tmp_path / "etcd").start()
    try:
        printed = rd.run_etcd_bootstrap(objects, etcd, tmp_path)
        assert f"'etrain-node-{agents[2].name}'" in printed, printed
        env = rd.expand_env(
            mf.container(agents[1], "agent")["env"],
            {},
            {"metadata.name": "p", "status.podIP": "1", "spec.nodeName": "k"},
        )
        files = rd.write_mounted_secrets(objects, agents[1], mf.container(agents[1], "agent"), tmp_path / "a1")
        options = {
            "ca_cert": files[env["ETRAIN_ETCD_CA_CERT"]],
            "cert": files[env["ETRAIN_ETCD_CERT"]],
            "cert_key": files[env["ETRAIN_ETCD_KEY"]],
            "user": env["ETRAIN_ETCD_USER"],
            "password": Path(files[env["ETRAIN_ETCD_PASSWORD_FILE"]]).read_text().strip(),
            "op_timeout": "5",
        }
        node = create_client(EtcdConfig.from_options(etcd.localize(env["ETRAIN_ETCD_ENDPOINTS"]), options))
        try:
            mine, other = agents[1].name, agents[0].name
            node.put(f"/etrain/nodes/{mine}", b"{}", lease=node.grant_lease(timedelta(seconds=10)))
            node.get_prefix(f"/etrain/assign/{mine}/")
            for key in (f"/etrain/nodes/{other}", f"/etrain/assign/{other}/j", "/etrain/jobs/j"):
                with pytest.raises(EtcdError, match="permission denied"):
                    node.put(key, b"{}")
            with pytest.raises(EtcdError, match="permission denied"):
                node.get_prefix(f"/etrain/assign/{other}/")
        finally:
            node.close()
    finally:
        etcd.stop()
    with pytest.raises(helm.HelmRenderError) as info:
        render(chart, {"etcd": {"auth": {"perNodeUsers": True}}, "agent": {"kind": "DaemonSet"}})
    assert "etcd.auth.perNodeUsers=true needs agent.kind=StatefulSet" in str(info.value)
