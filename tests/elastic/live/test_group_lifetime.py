"""A live group owns its generation's store for as long as the process group lives, and lets it go after.

torch's C++ side keeps only the C++ half of a Python ``Store``: when nothing in Python holds the
``EtcdV3Store``, it is collected, and the next call through torch's trampoline fails with "Not implemented".
NCCL makes that call at its first collective (the communicator is created lazily and its unique id goes
through the store), so live mode failed at its first step on every GPU. Under gloo the same call is
reached through the default group's ``PrefixStore``, which is what these tests use on a CPU: the store must
answer after ``gc.collect()`` while the group lives, and be gone after teardown. Where CUDA exists the NCCL
form runs too (``-m cuda``), with a real all-reduce after every re-form.
"""

from __future__ import annotations

import gc
import uuid
import weakref
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from elastic.etcd import create_client
from elastic.live.group import LiveGroup, LiveGroupFormationError, is_peer_failure
from elastic.live.membership import LiveMembership, LiveSettings
from elastic.live.protocol import LiveKeys, ReformReason
from elastic.rendezvous.etcd_v3_store import EtcdV3Store
from elastic.testing.etcd_server import LocalEtcdCluster

REFORMS = 100


@pytest.fixture(
    params=[
        "gloo",
        pytest.param(
            "nccl",
            marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="NCCL needs a CUDA GPU")],
        ),
    ]
)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _group(etcd: LocalEtcdCluster, backend: str, device: torch.device | None = None) -> tuple[LiveGroup, object]:
    client = create_client(etcd.config(op_timeout=5))
    keys = LiveKeys(f"/test/{uuid.uuid4().hex[:12]}/live/")
    settings = LiveSettings(
        1,
        1,
        settle=timedelta(seconds=0.1),
        last_call=timedelta(seconds=0.1),
        join_timeout=timedelta(seconds=30),
        reform_timeout=timedelta(seconds=30),
    )
    membership = LiveMembership(client, keys, f"lifetime-{backend}", settings, node="test")
    group = LiveGroup(
        client,
        keys,
        membership,
        backend,
        timeout=timedelta(seconds=60),
        store_timeout=timedelta(seconds=30),
        device=device,
    )
    return group, client


@pytest.fixture
def solo_group(etcd_server: LocalEtcdCluster, backend: str) -> Iterator[LiveGroup]:
    assert not dist.is_initialized(), "another test left a process group behind"
    device = torch.device("cuda", 0) if backend == "nccl" else None
    group, client = _group(etcd_server, backend, device)
    yield group
    group.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    client.close()  # type: ignore[attr-defined]


def _store_answers_through_torch(tag: str) -> None:
    """A set and a get through the default group's C++ ``PrefixStore``: the call NCCL makes at its first
    collective, into our Python store's methods."""
    default = dist.distributed_c10d._get_default_store()
    default.set(f"lifetime/{tag}", tag)
    assert default.get(f"lifetime/{tag}") == tag.encode()


def _collective_works(backend: str, value: float) -> None:
    device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
    t = torch.full((4,), value, device=device)
    dist.all_reduce(t)
    assert torch.equal(t.cpu(), torch.full((4,), value))


def _current_store(group: LiveGroup) -> weakref.ref[EtcdV3Store]:
    store = group.store
    assert isinstance(store, EtcdV3Store), store
    return weakref.ref(store)


@pytest.mark.timeout(60)
def test_the_group_keeps_its_store_alive_while_it_lives_and_releases_it_at_teardown(
    solo_group: LiveGroup, backend: str
) -> None:
    solo_group.join()
    first = _current_store(solo_group)
    gc.collect()
    assert first() is not None, "the live group's store was collected while its process group lives"
    _store_answers_through_torch("first")  # today's code: "Not implemented" (the Python object is gone)
    _collective_works(backend, 1.0)

    solo_group.reform(ReformReason.ADMIT)
    second = _current_store(solo_group)
    gc.collect()
    assert first() is None, "the torn-down generation's store is still referenced"
    assert second() is not None
    _store_answers_through_torch("second")
    _collective_works(backend, 2.0)

    solo_group.close()
    gc.collect()
    assert not dist.is_initialized()
    assert solo_group.store is None and second() is None, "the store outlived the closed group"


@pytest.mark.parametrize("backend", ["gloo"])  # NCCL's 100 re-forms: test_group_in_place.py (GPU time is short)
@pytest.mark.timeout(240)
def test_100_re_forms_keep_exactly_the_current_generation_store(solo_group: LiveGroup, backend: str) -> None:
    solo_group.join()
    refs = [_current_store(solo_group)]
    for i in range(REFORMS):
        solo_group.reform(ReformReason.ADMIT)
        refs.append(_current_store(solo_group))
        if i % 10 == 0:
            gc.collect()
        _store_answers_through_torch(f"g{i}")
        _collective_works(backend, float(i))
    gc.collect()
    alive = [i for i, ref in enumerate(refs) if ref() is not None]
    assert alive == [REFORMS], f"stores of generations at {alive} are still alive (expected only the last)"


@pytest.mark.timeout(60)
def test_a_group_that_cannot_form_says_why_at_formation_and_keeps_no_store(etcd_server: LocalEtcdCluster) -> None:
    """A backend torch does not know stands for any non-peer formation error (a wrong device, bad NCCL set-up):
    it surfaces from ``join()`` as one clear error that the loop does not retry, and nothing is left behind."""
    assert not dist.is_initialized()
    group, client = _group(etcd_server, "no-such-backend")
    try:
        with pytest.raises(LiveGroupFormationError, match="generation 1's no-such-backend process group") as info:
            group.join()
        assert not is_peer_failure(info.value)
        assert group.store is None and not dist.is_initialized()
    finally:
        group.close()
        client.close()  # type: ignore[attr-defined]
