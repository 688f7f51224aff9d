"""LiveGroup re-forms its process group in place, in one process, many times over, without leaking.

World size 1 on a real etcd: every re-form (``ReformReason.ADMIT`` commits at once when the only member
asks) tears the process group down and builds the next generation's over a fresh store prefix. After a
warm-up the process's open file descriptors, threads and RSS (and, under NCCL, the CUDA memory allocated)
must stay flat. Also here: ``broadcast_state`` at world 1 and ``is_peer_failure``'s classification.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from elastic.etcd import create_client
from elastic.live.group import LiveGroup, is_peer_failure
from elastic.live.membership import LiveMembership, LiveSettings
from elastic.live.protocol import Generation, LiveKeys, ReformReason
from elastic.live.state_sync import broadcast_state
from elastic.testing.etcd_server import LocalEtcdCluster

WARMUP = 10
REFORMS = 100
MAX_FD_GROWTH = 4
MAX_THREAD_GROWTH = 2
MAX_RSS_GROWTH = 48 * 1024 * 1024  # bytes; a leak of one process group per generation would pass it quickly


@dataclass(frozen=True)
class Usage:
    fds: int
    os_threads: int
    py_threads: int
    rss: int  # bytes
    cuda_allocated: int  # bytes (0 off CUDA)

    def __str__(self) -> str:
        return (
            f"fds={self.fds} os_threads={self.os_threads} py_threads={self.py_threads} "
            f"rss={self.rss / 2**20:.1f}MiB cuda_allocated={self.cuda_allocated}"
        )


def usage(device: torch.device) -> Usage:
    with open("/proc/self/statm") as f:
        rss_pages = int(f.read().split()[1])
    return Usage(
        fds=len(os.listdir("/proc/self/fd")),
        os_threads=len(os.listdir("/proc/self/task")),
        py_threads=threading.active_count(),
        rss=rss_pages * os.sysconf("SC_PAGE_SIZE"),
        cuda_allocated=torch.cuda.memory_allocated(device) if device.type == "cuda" else 0,
    )


def _destroy_default_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(
    params=[
        "gloo",
        pytest.param(
            "nccl",
            marks=[
                pytest.mark.cuda,
                pytest.mark.skipif(
                    not torch.cuda.is_available(),
                    reason="NCCL needs a CUDA GPU; torch.cuda.is_available() is False here",
                ),
            ],
        ),
    ]
)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def device(backend: str) -> torch.device:
    if backend == "nccl":
        torch.cuda.set_device(0)
        return torch.device("cuda", 0)
    return torch.device("cpu")


@pytest.fixture
def solo_group(etcd_server: LocalEtcdCluster, backend: str) -> Iterator[LiveGroup]:
    """A one-member live group on the shared etcd, under a prefix of its own (not joined yet)."""
    assert not dist.is_initialized(), "another test left a process group behind"
    client = create_client(etcd_server.config(op_timeout=5))
    keys = LiveKeys(f"/test/{uuid.uuid4().hex[:12]}/live/")
    settings = LiveSettings(
        1,
        1,
        settle=timedelta(seconds=0.1),
        last_call=timedelta(seconds=0.1),
        join_timeout=timedelta(seconds=30),
        reform_timeout=timedelta(seconds=30),
    )
    membership = LiveMembership(client, keys, f"solo-{backend}", settings, node="test")
    group = LiveGroup(
        client, keys, membership, backend, timeout=timedelta(seconds=60), store_timeout=timedelta(seconds=30)
    )
    yield group
    _destroy_default_group()
    group.close()
    client.close()


def _all_reduce_works(device: torch.device, value: float) -> None:
    t = torch.full((8,), value, device=device)
    dist.all_reduce(t)
    assert torch.equal(t.cpu(), torch.full((8,), value)), t


@pytest.mark.timeout(240)
def test_a_live_group_re_forms_100_times_in_place_without_growing_fds_threads_or_memory(
    solo_group: LiveGroup, backend: str, device: torch.device
) -> None:
    gen = solo_group.join()
    assert gen == Generation(1, (solo_group.wid,), ReformReason.FOUNDED)
    assert (solo_group.rank, solo_group.world_size, dist.get_backend()) == (0, 1, backend)
    _all_reduce_works(device, 1.0)

    def reform_once() -> None:
        before = solo_group.generation
        assert before is not None
        new = solo_group.reform(ReformReason.ADMIT)
        assert new == Generation(before.number + 1, (solo_group.wid,), ReformReason.ADMIT)
        assert solo_group.generation == new and dist.is_initialized()
        assert (solo_group.rank, solo_group.world_size) == (0, 1)
        _all_reduce_works(device, float(new.number))

    for _ in range(WARMUP):
        reform_once()
    baseline = usage(device)
    for _ in range(REFORMS):
        reform_once()
    after = usage(device)
    print(f"\n[{backend}] after {WARMUP} warm-up re-forms: {baseline}")
    print(f"[{backend}] after {REFORMS} more re-forms:   {after}")

    assert solo_group.reforms == WARMUP + REFORMS
    last = solo_group.generation
    assert last is not None and last.number == 1 + WARMUP + REFORMS
    assert after.fds - baseline.fds <= MAX_FD_GROWTH, f"file descriptors grew: {baseline} -> {after}"
    assert after.os_threads - baseline.os_threads <= MAX_THREAD_GROWTH, f"threads grew: {baseline} -> {after}"
    assert after.py_threads - baseline.py_threads <= MAX_THREAD_GROWTH, f"threads grew: {baseline} -> {after}"
    assert after.rss - baseline.rss <= MAX_RSS_GROWTH, f"RSS grew: {baseline} -> {after}"
    assert after.cuda_allocated <= baseline.cuda_allocated, f"CUDA memory grew: {baseline} -> {after}"

    # etcd does not grow either: only the last two generations' stores and ready marks are left
    keys = solo_group._keys
    last_two = {last.number - 1, last.number}
    assert last.number in _generations_under(solo_group, keys.store) <= last_two
    assert last.number in _generations_under(solo_group, keys.membership + "ready/") <= last_two


def _generations_under(group: LiveGroup, prefix: str) -> set[int]:
    """The generation numbers that have keys under ``prefix`` + ``<g>/``."""
    kvs, _ = group._client.get_prefix(prefix)
    return {int(kv.key[len(prefix) :].split("/")[0]) for kv in kvs}


# -- broadcast_state, is_peer_failure ----------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_broadcast_state_at_world_1_returns_the_state_unchanged(gloo_world_1: None) -> None:
    weights = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    state: dict[str, Any] = {
        "model": {"w": weights, "b": torch.zeros(3, dtype=torch.float64)},
        "optimizer": [{"step": torch.tensor(4), "lr": 0.1}, ("adam", None)],
        "step": 7,
        "name": "run",
    }
    got = broadcast_state(state, src=0, device=torch.device("cpu"))
    assert got is state
    assert got["model"]["w"] is weights and torch.equal(weights, torch.arange(6, dtype=torch.float32).reshape(2, 3))
    assert got["optimizer"] == [{"step": torch.tensor(4), "lr": 0.1}, ("adam", None)]
    assert (got["step"], got["name"]) == (7, "run")


GLOO_RESET = (
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:51234: Connection reset by peer"
)


@pytest.mark.parametrize(
    ("exc", "peer"),
    [
        pytest.param(RuntimeError(GLOO_RESET), True, id="gloo-connection-reset"),
        pytest.param(RuntimeError("Connection reset by peer"), True, id="bare-connection-reset"),
        pytest.param(dist.DistNetworkError("recv failed"), True, id="dist-network-error"),
        pytest.param(
            RuntimeError("The size of tensor a (3) must match the size of tensor b (4) at non-singleton dimension 0"),
            False,
            id="shape-mismatch",
        ),
        pytest.param(
            RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 4x5)"), False, id="matmul-shapes"
        ),
        pytest.param(ValueError("Connection reset by peer"), False, id="value-error"),
        pytest.param(ValueError("expected a tensor of shape (3,)"), False, id="value-error-shape"),
    ],
)
@pytest.mark.timeout(10)
def test_is_peer_failure_tells_a_broken_group_from_an_error_of_the_training_code(
    exc: BaseException, peer: bool
) -> None:
    assert is_peer_failure(exc) is peer
