"""The namespace helper of the chaos suite, on real namespaces, veths, a bridge and nftables (root needed)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.integration.netns import (
    NetnsError,
    NetnsTopology,
    cleanup_stale,
    create_topology,
    stale_runs,
    unavailable_reason,
)

REASON = unavailable_reason()
# with the chaos suite on one worker: one test plants a dead creator's namespace for its own cleanup to find,
# which any other create_topology() would remove first (tests/parallel.py)
pytestmark = pytest.mark.xdist_group("netns")
needs_netns = pytest.mark.skipif(REASON is not None, reason=f"network namespaces unavailable: {REASON}")
PORT = 47001
LISTEN = (
    "import socket\n"
    "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    f"s.bind(('0.0.0.0', {PORT})); s.listen(16); print('ready', flush=True)\n"
    "while True:\n"
    "    s.accept()[0].close()\n"
)


def _listen(prefix: list[str]) -> subprocess.Popen[str]:
    proc = subprocess.Popen([*prefix, sys.executable, "-c", LISTEN], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def _connects(prefix: list[str], host: str) -> bool:
    code = f"import socket; socket.create_connection(({host!r}, {PORT}), timeout=1.5).close()"
    return subprocess.run([*prefix, sys.executable, "-c", code], capture_output=True, timeout=30).returncode == 0


def _root_links() -> str:
    return subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout


@needs_netns
@pytest.mark.timeout(90)
def test_nodes_reach_hub_and_each_other_a_partition_cuts_one_node_off_heal_restores_teardown_leaves_nothing() -> None:
    links_before = _root_links()
    topo = create_topology(["a", "b"])
    try:
        hub, a, b = topo.exec_prefix(topo.hub), topo.node_prefix("a"), topo.node_prefix("b")
        listeners = [_listen(hub), _listen(a)]
        assert _connects(a, topo.hub_address) and _connects(b, topo.nodes["a"].address)
        assert not topo.partitioned("a")

        topo.partition("a")
        assert topo.partitioned("a")
        assert not _connects(a, topo.hub_address), "outgoing traffic of the partitioned node still passes"
        assert not _connects(b, topo.nodes["a"].address), "incoming traffic of the partitioned node still passes"
        assert _connects(b, topo.hub_address), "the partition hit another node"
        assert _connects(a, "127.0.0.1"), "the partition cut the node's loopback"

        topo.heal("a")
        topo.heal("a")  # healing twice is harmless
        assert not topo.partitioned("a")
        assert _connects(a, topo.hub_address) and _connects(b, topo.nodes["a"].address)
        namespaces = topo.namespaces()
        assert all(ns in _namespaces() for ns in namespaces)
    finally:
        topo.teardown()
    for proc in listeners:  # teardown killed what ran inside the namespaces
        assert proc.wait(timeout=10) == -9
    assert not any(ns in _namespaces() for ns in namespaces)
    assert "etrain-" not in _root_links() and _root_links().count("\n") == links_before.count("\n")
    topo.teardown()  # idempotent


@needs_netns
@pytest.mark.timeout(60)
def test_a_topology_survives_a_trip_through_json_to_a_process_in_the_hub() -> None:
    with create_topology(["x"]) as topo:
        back = NetnsTopology.from_json(topo.to_json())
        assert back == topo and back.nodes["x"].address.startswith("10.231.")
        code = "import socket; print(sorted(name for _, name in socket.if_nameindex()))"
        out = subprocess.run(
            [*back.node_prefix("x"), sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout
        assert out.strip() == str(sorted(["lo", back.nodes["x"].ifname]))


@needs_netns
@pytest.mark.timeout(60)
def test_cleanup_removes_idle_namespaces_of_a_dead_creator_and_keeps_a_live_creators() -> None:
    dead = 4_000_000  # above any pid this machine hands out (pid_max is at most 4194304)
    while True:
        try:
            os.kill(dead, 0)
            dead += 1
        except ProcessLookupError:
            break
    mine, theirs = f"etrain-{os.getpid()}xaaaa-hub", f"etrain-{dead}xbbbb-hub"
    for name in (mine, theirs):
        subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        removed = cleanup_stale()
        assert theirs in removed and theirs not in _namespaces()
        assert mine not in removed and mine in _namespaces()
    finally:
        for name in (mine, theirs):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def test_stale_runs_are_whole_idle_runs_of_dead_creators_and_never_foreign_names() -> None:
    names = [
        "etrain-10xabcd-hub",
        "etrain-10xabcd-n1",
        "etrain-11x0000-hub",
        "etrain-12x0001-hub",
        "etrain-12x0001-n1",
        "etrain-other",
        "mine-10xabcd-hub",
    ]
    busy = {n: False for n in names} | {"etrain-12x0001-n1": True}
    alive = {10: False, 11: True, 12: False}
    # run 10: creator gone, idle -> both removed; 11: creator alive; 12: a process still runs in n1
    assert stale_runs(names, busy, alive) == ["etrain-10xabcd-hub", "etrain-10xabcd-n1"]
    assert stale_runs(names, {}, alive) == []  # unknown: busy


@needs_netns
@pytest.mark.timeout(60)
def test_a_failed_build_tears_down_what_it_made() -> None:
    topo = NetnsTopology("1x0000", 20, ("a", "b"))
    taken = f"etrain-{topo.run_id}-n2"
    subprocess.run(["ip", "netns", "add", taken], check=True)
    try:
        with pytest.raises(NetnsError, match="netns add"):
            topo.create()
        assert topo.hub not in _namespaces() and f"etrain-{topo.run_id}-n1" not in _namespaces()
        assert taken in _namespaces()  # not ours
    finally:
        subprocess.run(["ip", "netns", "del", taken], capture_output=True)
