"""Network namespaces for tests that cut a node off the network: one hub, one namespace per node, nftables.

Layout of one topology (``<id>`` is ``<creator pid>x<4 random hex>``; nothing is added to the root
namespace, so only namespaces this module creates are ever touched):

- ``etrain-<id>-hub``: a Linux bridge ``etrain-br0`` with ``10.231.<x>.1/24`` (``x`` random, 16..250)
  and ``lo`` up. Whatever every node must reach (etcd, the controller, the test driving them) runs here.
- ``etrain-<id>-n<i>``: node ``i`` (1-based), attached to the bridge by a veth pair created inside the hub
  (``etrain-h<i>`` there, :data:`NODE_IFNAME` in the node) with ``10.231.<x>.<10+i>/24``.

:meth:`NetnsTopology.partition` loads an nftables table into one node's namespace that drops every
packet in and out except on ``lo``; :meth:`NetnsTopology.heal` deletes it. :meth:`NetnsTopology.teardown`
kills every process left in the topology's namespaces and deletes them (their veths and the bridge go
with them). :func:`cleanup_stale` deletes the namespaces of earlier runs whose creator is gone and in
which no process runs any more. Needs root (or CAP_NET_ADMIN and CAP_SYS_ADMIN), ``ip`` (iproute2) and
``nft`` (nftables); :func:`unavailable_reason` says why not where that is missing.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

logger = logging.getLogger(__name__)

__all__ = [
    "NODE_IFNAME",
    "NetnsError",
    "NetnsNode",
    "NetnsTopology",
    "cleanup_stale",
    "create_topology",
    "stale_runs",
    "unavailable_reason",
]

PREFIX = "etrain-"
BRIDGE = "etrain-br0"
#: the interface name of a node's side of its veth pair, the same in every node namespace
NODE_IFNAME = "etrain-eth0"
PARTITION_TABLE = "etrain_partition"
_PARTITION_RULES = f"""
table inet {PARTITION_TABLE} {{
  chain input {{ type filter hook input priority -300; policy drop; iifname "lo" accept; }}
  chain output {{ type filter hook output priority -300; policy drop; oifname "lo" accept; }}
}}
"""
_NAME = re.compile(r"^etrain-(?P<owner>\d+)x[0-9a-f]{4}-(?:hub|n\d+|probe)$")


class NetnsError(RuntimeError):
    """A namespace, link or nftables command failed (the message has the command and its stderr)."""


def _run(cmd: Sequence[str], input: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        proc = subprocess.run(list(cmd), input=input, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetnsError(f"{' '.join(cmd)}: {exc}") from exc
    if check and proc.returncode != 0:
        raise NetnsError(f"{' '.join(cmd)}: {proc.stderr.strip() or f'exit {proc.returncode}'}")
    return proc


@dataclass(frozen=True)
class NetnsNode:
    """One node's namespace, its address on the bridge and the interface that carries it."""

    name: str
    namespace: str
    address: str
    ifname: str = NODE_IFNAME


@dataclass
class NetnsTopology:
    """A hub namespace with a bridge and one namespace per node; build it with :func:`create_topology`.

    Contract: after :meth:`create` every node reaches ``hub_address`` and the other nodes' addresses;
    :meth:`teardown` is idempotent, never raises, and leaves none of the topology's namespaces (nor
    processes in them) behind.
    """

    run_id: str
    subnet: int  # the x of 10.231.x.0/24
    node_names: tuple[str, ...]
    nodes: dict[str, NetnsNode] = field(default_factory=dict)
    created: list[str] = field(default_factory=list)  # namespaces, in creation order

    @property
    def hub(self) -> str:
        return f"{PREFIX}{self.run_id}-hub"

    @property
    def hub_address(self) -> str:
        return f"10.231.{self.subnet}.1"

    def namespaces(self) -> list[str]:
        return [self.hub, *(n.namespace for n in self.nodes.values())]

    @staticmethod
    def exec_prefix(namespace: str) -> list[str]:
        """The command prefix that runs a program inside ``namespace``."""
        return ["ip", "netns", "exec", namespace]

    def node_prefix(self, name: str) -> list[str]:
        return self.exec_prefix(self.nodes[name].namespace)

    # -- building and tearing down ---------------------------------------------------------------------
    def create(self) -> NetnsTopology:
        try:
            self._add_namespace(self.hub)
            _run(["ip", "-n", self.hub, "link", "add", BRIDGE, "type", "bridge"])
            _run(["ip", "-n", self.hub, "addr", "add", f"{self.hub_address}/24", "dev", BRIDGE])
            _run(["ip", "-n", self.hub, "link", "set", BRIDGE, "up"])
            for i, name in enumerate(self.node_names, start=1):
                node = NetnsNode(name, f"{PREFIX}{self.run_id}-n{i}", f"10.231.{self.subnet}.{10 + i}")
                self._add_namespace(node.namespace)
                hub_end = f"{PREFIX}h{i}"
                _run(
                    [
                        "ip",
                        "-n",
                        self.hub,
                        "link",
                        "add",
                        hub_end,
                        "type",
                        "veth",
                        "peer",
                        "name",
                        node.ifname,
                        "netns",
                        node.namespace,
                    ]
                )
                _run(["ip", "-n", self.hub, "link", "set", hub_end, "master", BRIDGE])
                _run(["ip", "-n", self.hub, "link", "set", hub_end, "up"])
                _run(["ip", "-n", node.namespace, "addr", "add", f"{node.address}/24", "dev", node.ifname])
                _run(["ip", "-n", node.namespace, "link", "set", node.ifname, "up"])
                self.nodes[name] = node
        except BaseException:
            self.teardown()
            raise
        logger.info(
            "netns: hub %s at %s; nodes %s",
            self.hub,
            self.hub_address,
            ", ".join(f"{n.name}={n.namespace}/{n.address}" for n in self.nodes.values()),
        )
        return self

    def _add_namespace(self, namespace: str) -> None:
        _run(["ip", "netns", "add", namespace])
        self.created.append(namespace)
        _run(["ip", "-n", namespace, "link", "set", "lo", "up"])

    def teardown(self) -> None:
        """Kill what still runs in the namespaces, then delete them (nodes first, the hub last)."""
        for namespace in reversed(self.created):
            _kill_inside(namespace)
        for namespace in reversed(self.created):
            proc = _run(["ip", "netns", "del", namespace], check=False)
            if proc.returncode != 0 and namespace in _list_namespaces():
                logger.warning("netns: cannot delete %s: %s", namespace, proc.stderr.strip())
        self.created.clear()
        self.nodes.clear()

    def __enter__(self) -> NetnsTopology:
        return self.create() if not self.created else self

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    # -- faults ----------------------------------------------------------------------------------------
    def partition(self, name: str) -> None:
        """Drop every packet into and out of node ``name`` except on its ``lo``."""
        _run([*self.node_prefix(name), "nft", "-f", "-"], input=_PARTITION_RULES)

    def heal(self, name: str) -> None:
        """Remove the partition of node ``name`` (nothing happens when there is none)."""
        if self.partitioned(name):
            _run([*self.node_prefix(name), "nft", "delete", "table", "inet", PARTITION_TABLE])

    def partitioned(self, name: str) -> bool:
        proc = _run([*self.node_prefix(name), "nft", "list", "tables"])
        return f"inet {PARTITION_TABLE}" in proc.stdout

    # -- passing it to a process running in the hub ----------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> NetnsTopology:
        data = json.loads(text)
        nodes = {k: NetnsNode(**v) for k, v in data.pop("nodes").items()}
        return cls(**{**data, "node_names": tuple(data["node_names"]), "nodes": nodes})


def create_topology(node_names: Iterable[str], subnet: int | None = None) -> NetnsTopology:
    """Build a hub and one namespace per node (a random 10.231.x.0/24 unless ``subnet``); removes stale
    namespaces of crashed earlier runs first."""
    cleanup_stale()
    run_id = f"{os.getpid()}x{random.randrange(16**4):04x}"
    x = subnet if subnet is not None else random.randint(16, 250)
    return NetnsTopology(run_id, x, tuple(node_names)).create()


# -- environment checks ----------------------------------------------------------------------------------
def unavailable_reason() -> str | None:
    """None when namespaces and nftables work here, else why not (one line)."""
    for tool, package in (("ip", "iproute2"), ("nft", "nftables")):
        if shutil.which(tool) is None:
            return f"no {tool!r} command (apt-get install {package})"
    probe = f"{PREFIX}{os.getpid()}x{random.randrange(16**4):04x}-probe"
    try:
        _run(["ip", "netns", "add", probe])
    except NetnsError as exc:
        return f"cannot create a network namespace (needs root or CAP_NET_ADMIN): {exc}"
    try:
        _run(["ip", "netns", "exec", probe, "nft", "list", "tables"])
    except NetnsError as exc:
        return f"nftables does not work in a network namespace: {exc}"
    finally:
        _run(["ip", "netns", "del", probe], check=False)
    return None


# -- leftovers of crashed runs ---------------------------------------------------------------------------
def _list_namespaces() -> list[str]:
    try:
        out = _run(["ip", "netns", "list"]).stdout
    except NetnsError:
        return []
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pids_inside(namespace: str) -> list[int]:
    proc = _run(["ip", "netns", "pids", namespace], check=False)
    return [int(p) for p in proc.stdout.split() if p.isdigit()]


def _kill_inside(namespace: str) -> None:
    """SIGKILL every process in ``namespace`` (except this one) and wait a little for them to go."""
    own = os.getpid()
    deadline = time.monotonic() + 10
    while (pids := [p for p in _pids_inside(namespace) if p != own]) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stale_runs(namespaces: Iterable[str], busy: Mapping[str, bool], owner_alive: Mapping[int, bool]) -> list[str]:
    """Which ``etrain-`` namespaces to delete: those of runs whose creator is gone and none of whose
    namespaces holds a process (``busy``). Names of other forms are never chosen."""
    runs: dict[str, list[str]] = {}
    owners: dict[str, int] = {}
    for name in namespaces:
        m = _NAME.match(name)
        if m is None:
            continue
        run = name.rsplit("-", 1)[0]
        runs.setdefault(run, []).append(name)
        owners[run] = int(m.group("owner"))
    stale: list[str] = []
    for run, names in sorted(runs.items()):
        if not owner_alive.get(owners[run], True) and not any(busy.get(n, True) for n in names):
            stale.extend(sorted(names))
    return stale


def cleanup_stale() -> list[str]:
    """Delete the namespaces left by earlier runs that crashed (see :func:`stale_runs`); the deleted names."""
    names = [n for n in _list_namespaces() if n.startswith(PREFIX)]
    if not names:
        return []
    owners = {int(m.group("owner")) for n in names if (m := _NAME.match(n))}
    stale = stale_runs(names, {n: bool(_pids_inside(n)) for n in names}, {o: _alive(o) for o in owners})
    for name in stale:
        _run(["ip", "netns", "del", name], check=False)
    if stale:
        logger.warning("netns: removed %d stale namespaces of crashed runs: %s", len(stale), ", ".join(stale))
    return stale
