"""Device-side staging and the staging warm-up, on CPU: the plan (pure), the device buffer pool over an
in-memory device (:class:`HostDeviceMemory`), and the stager and manager over in-memory copy streams
(:class:`HostCopyOps`, whose "device" tensors are CPU tensors and whose copy stream is a thread).

The CUDA counterparts (marked ``cuda``) are at the end and skip without a GPU.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from elastic.checkpoint import CheckpointOptions, CheckpointWriteError, create_checkpoint_manager
from elastic.checkpoint.device_copy import HostCopyOps, Phase, QueuedCopy, StagingCopyError
from elastic.checkpoint.device_staging import (
    DeviceBufferPool,
    DeviceStagingSettings,
    HostDeviceMemory,
    StageRequest,
    plan_device_staging,
)
from elastic.checkpoint.manager import FsspecCheckpointManager
from elastic.checkpoint.staging import Stager
from tests.elastic.checkpoint._helpers import assert_same

MIB = 1 << 20
NO_MARGIN = DeviceStagingSettings(margin_bytes=0, margin_fraction=0.0)
DEVICE_LOGGER = "elastic.checkpoint.device_staging"


def req(index: int, mib: int, device: int = 0) -> StageRequest:
    return StageRequest(index, device, (mib * MIB // 4,), torch.float32)


def cpu_clone(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: cpu_clone(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [cpu_clone(v) for v in obj]
    return obj


# -- the plan (pure) --------------------------------------------------------------------------------------
def test_plan_stages_every_tensor_when_memory_allows() -> None:
    plan = plan_device_staging([req(2, 4), req(0, 8), req(1, 1)], (), {0: (100 * MIB, 200 * MIB)}, NO_MARGIN)
    assert plan.staged == (0, 1, 2) and plan.direct == () and plan.all_staged
    assert plan.budgets[0].needed == 13 * MIB and plan.budgets[0].direct == 0
    assert plan.reason.startswith("all tensors fit")


def test_plan_falls_back_per_tensor_in_index_order_when_memory_is_short() -> None:
    requests = [req(3, 2), req(0, 6), req(1, 5), req(2, 3)]
    plan = plan_device_staging(requests, (), {0: (10 * MIB, 80 * MIB)}, NO_MARGIN)
    # index order, first fit: 0 (6) fits, 1 (5) does not, 2 (3) fits, 3 (2) does not (1 left)
    assert plan.staged == (0, 2) and plan.direct == (1, 3)
    assert plan.budgets[0].needed == 9 * MIB and plan.budgets[0].direct == 7 * MIB
    assert plan == plan_device_staging(list(reversed(requests)), (), {0: (10 * MIB, 80 * MIB)}, NO_MARGIN)
    assert "do not" in plan.reason


def test_plan_keeps_the_margin_free() -> None:
    requests = [req(0, 4)]
    by_bytes = DeviceStagingSettings(margin_bytes=16 * MIB, margin_fraction=0.0)
    assert plan_device_staging(requests, (), {0: (20 * MIB, 100 * MIB)}, by_bytes).staged == (0,)
    assert plan_device_staging(requests, (), {0: (20 * MIB - 1, 100 * MIB)}, by_bytes).direct == (0,)
    by_fraction = DeviceStagingSettings(margin_bytes=1 * MIB, margin_fraction=0.5)  # 50 MiB of 100 MiB
    assert plan_device_staging(requests, (), {0: (54 * MIB, 100 * MIB)}, by_fraction).staged == (0,)
    assert plan_device_staging(requests, (), {0: (53 * MIB, 100 * MIB)}, by_fraction).direct == (0,)


def test_plan_counts_held_buffers_free_and_budgets_each_device() -> None:
    requests = [req(0, 8, device=0), req(1, 8, device=1), req(2, 8, device=0)]
    memory = {0: (9 * MIB, 64 * MIB), 1: (1 * MIB, 64 * MIB)}
    plan = plan_device_staging(requests, held=[1], memory=memory, settings=NO_MARGIN)
    assert plan.staged == (0, 1) and plan.direct == (2,)
    assert plan.budgets[1].reused == 8 * MIB and plan.budgets[1].needed == 0


def test_plan_when_off_copies_everything_directly() -> None:
    plan = plan_device_staging([req(0, 1)], (), {}, DeviceStagingSettings(enabled=False))
    assert plan.staged == () and plan.direct == (0,) and "off" in plan.reason


def test_settings_reject_bad_margins() -> None:
    with pytest.raises(ValueError, match="margin_fraction"):
        DeviceStagingSettings(margin_fraction=1.0)
    with pytest.raises(ValueError, match="margin_bytes"):
        DeviceStagingSettings(margin_bytes=-1)
    with pytest.raises(ValueError, match="device_staging_margin_fraction"):
        CheckpointOptions(device_staging_margin_fraction=-0.1)


# -- the device buffer pool -------------------------------------------------------------------------------
def test_pool_reuses_buffers_and_replans_when_shapes_change(caplog: pytest.LogCaptureFixture) -> None:
    memory = HostDeviceMemory(free=64 * MIB)
    pool = DeviceBufferPool(memory, NO_MARGIN)
    with caplog.at_level(logging.INFO, logger=DEVICE_LOGGER):
        assert pool.ensure([req(0, 4), req(1, 4)]).staged == (0, 1)
        first = [pool.buffer(0).data_ptr(), pool.buffer(1).data_ptr()]
        assert memory.allocations == 2
        assert pool.ensure([req(0, 4), req(1, 4)]).staged == (0, 1)
    assert memory.allocations == 2  # unchanged shapes: nothing allocated
    assert [pool.buffer(0).data_ptr(), pool.buffer(1).data_ptr()] == first
    infos = [r for r in caplog.records if r.levelno == logging.INFO]
    assert len(infos) == 1 and "device-side" in infos[0].getMessage()  # said once, not every save

    assert pool.ensure([req(0, 4), req(1, 2)]).staged == (0, 1)  # a new shape at index 1: a new buffer
    assert memory.allocations == 3 and pool.buffer(0).data_ptr() == first[0]
    assert pool.held_bytes == 6 * MIB


def test_pool_falls_back_when_an_allocation_fails_after_all() -> None:
    memory = HostDeviceMemory(free=64 * MIB)
    pool = DeviceBufferPool(memory, NO_MARGIN)
    memory.mem_info = lambda device: (64 * MIB, 64 * MIB)  # type: ignore[method-assign]  # over-reports
    memory.set_free(5 * MIB)  # what it can really hand out
    plan = pool.ensure([req(0, 4), req(1, 4)])
    assert plan.staged == (0,) and plan.direct == (1,) and "allocation" in plan.reason


def test_after_an_allocation_fails_a_pool_tries_no_more_until_more_memory_is_reported_free(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # the device reports 64 MiB free but hands out 5 (another process, or a memory fraction): each refusal would
    # empty torch's cache (a device sync) at every save, for every tensor
    memory = HostDeviceMemory(free=64 * MIB, obtainable=5 * MIB)
    pool = DeviceBufferPool(memory, NO_MARGIN)
    state = [req(i, 4) for i in range(10)]
    plan = pool.ensure(state)
    assert plan.staged == (0,) and plan.direct == tuple(range(1, 10))
    assert memory.refusals == 1, "the first refusal ends this plan's allocations on that device"
    assert "9 tensor(s) direct after a device buffer allocation failed" in plan.reason
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=DEVICE_LOGGER):
        for _ in range(3):
            plan = pool.ensure(state)
            assert plan.staged == (0,) and plan.direct == tuple(range(1, 10))  # the buffer held is still used
    assert memory.refusals == 1 and memory.allocations == 1
    assert "no new buffer while no more than 64.0 MiB is reported free" in plan.reason
    assert not [r for r in caplog.records if r.levelno >= logging.INFO], "an unchanged decision is not logged again"
    memory.set_free(256 * MIB)
    memory.obtainable = None  # memory was released: tried again
    assert pool.ensure(state).staged == tuple(range(10)) and memory.allocations == 10


class CachedDeviceMemory(HostDeviceMemory):
    """A device whose driver figure does not drop when a buffer is handed out: torch's caching allocator carving
    it from memory it already holds (the activations freed at a step boundary), which the next forward takes back
    from the driver."""

    def mem_info(self, device: int) -> tuple[int, int]:
        return self._free, self._total

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, device: int) -> torch.Tensor:
        self.allocations += 1
        return torch.empty(shape, dtype=dtype)  # the cache has it; what the pools hold is the pools' to bound


def test_two_pools_on_one_device_never_hold_more_than_its_free_memory_between_them() -> None:
    """The durable manager's and the node-local tier's pools: each plans against the driver's figure, which their
    buffers need not lower; a pool's budget leaves out what the other holds, and gets it back once released."""
    memory = CachedDeviceMemory(free=64 * MIB)
    durable, local = DeviceBufferPool(memory, NO_MARGIN), DeviceBufferPool(memory, NO_MARGIN)
    state = [req(i, 10) for i in range(4)]  # 40 MiB
    assert durable.ensure(state).staged == (0, 1, 2, 3)
    plan = local.ensure(state)
    assert plan.staged == (0, 1) and plan.direct == (2, 3), plan.reason  # 24 MiB left: two 10 MiB tensors
    assert durable.held_bytes + local.held_bytes <= 64 * MIB
    assert durable.ensure(state).staged == (0, 1, 2, 3), "a pool's own buffers stay free of charge"
    durable.release()
    assert local.ensure(state).staged == (0, 1, 2, 3)
    other_device = DeviceBufferPool(CachedDeviceMemory(free=64 * MIB), NO_MARGIN)
    assert other_device.ensure(state).staged == (0, 1, 2, 3), "pools over another memory object do not count"


def test_the_managers_pools_share_the_process_cuda_memory(tmp_path: Path) -> None:
    from elastic.checkpoint.device_staging import CUDA_MEMORY

    with (
        create_checkpoint_manager(str(tmp_path / "a")) as a,
        create_checkpoint_manager(str(tmp_path / "b")) as b,
    ):
        pools = [m._stager.device_pool for m in (a, b)]
        assert all(p is not None and p._memory is CUDA_MEMORY for p in pools)


# -- the stager over in-memory copy streams ---------------------------------------------------------------
@pytest.fixture
def ops() -> Iterator[HostCopyOps]:
    copy_ops = HostCopyOps()
    yield copy_ops
    copy_ops.close()


def stager_for(ops: HostCopyOps, free: int, settings: DeviceStagingSettings = NO_MARGIN) -> Stager:
    return Stager(pinned_limit_bytes=0, ops=ops, device_pool=DeviceBufferPool(HostDeviceMemory(free), settings))


def wait_until(predicate: Any, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


@pytest.mark.timeout(60)
def test_fence_waits_for_the_device_copy_only_and_the_writer_for_the_drain(ops: HostCopyOps) -> None:
    state = {"w": torch.randn(256, 64), "b": torch.randn(64)}
    expected = cpu_clone(state)
    stager = stager_for(ops, free=64 * MIB)
    ops.hold("drain")
    flat = stager.flatten(state, copy=True)  # early tensors: the host (the "current stream") waits for stage
    assert flat.device_staged == (0, 1)
    for t in state.values():
        t.add_(1.0)  # the next step changes the sources: the device buffers hold the save-time values

    reader = threading.Thread(target=flat.finish_staging)
    reader.start()
    time.sleep(0.2)
    assert reader.is_alive()  # the writer does not read a host buffer before the drain
    assert not any(phase == "drain" for phase, _ in ops.log)
    ops.release("drain")
    reader.join(10)
    assert not reader.is_alive() and flat.device_copies_done
    drained = [ptr for phase, ptr in ops.log if phase == "drain"]
    assert sorted(drained) == sorted(t.data_ptr() for t in flat.tensors)
    assert all(torch.equal(t, e) for t, e in zip(flat.tensors, expected.values(), strict=True))


@pytest.mark.timeout(60)
def test_short_device_memory_stages_some_tensors_and_copies_the_rest_directly(ops: HostCopyOps) -> None:
    state = {"a": torch.randn(MIB // 4), "b": torch.randn(3 * MIB // 4), "c": torch.randn(MIB // 4)}
    expected = cpu_clone(state)
    stager = stager_for(ops, free=2 * MIB + 1024)
    flat = stager.flatten(state, copy=True)
    assert flat.device_staged == (0, 2)  # "b" (3 MiB) does not fit in what "a" left
    flat.finish_staging()
    assert all(torch.equal(t, e) for t, e in zip(flat.tensors, expected.values(), strict=True))
    stage_copies = [ptr for phase, ptr in ops.log if phase == "stage"]
    assert stage_copies[-1] == flat.tensors[1].data_ptr()  # the direct copy (into the host buffer) comes last


@pytest.mark.timeout(60)
def test_a_failed_drain_fails_the_save_instead_of_hanging(tmp_path: Path, ops: HostCopyOps) -> None:
    ops.fail("drain")
    model = nn.Linear(32, 32)
    optimizer = torch.optim.AdamW(model.parameters())
    mgr = create_checkpoint_manager(str(tmp_path), stager=stager_for(ops, free=64 * MIB))
    mgr.save(1, {"model": model.state_dict(), "optimizer": optimizer.state_dict()}, overlap_with=optimizer)
    model(torch.randn(4, 32)).sum().backward()
    optimizer.step()  # the fence (the stage copies) is not held by the failed drain
    with pytest.raises(CheckpointWriteError, match="injected failure of a drain copy"):
        mgr.wait()
    assert mgr.list_snapshots() == []
    mgr.close()


def test_a_failed_stage_copy_does_not_raise_in_the_fence(ops: HostCopyOps) -> None:
    ops.fail("stage")
    stager = stager_for(ops, free=64 * MIB)
    flat = stager.flatten({"w": torch.randn(8)}, copy=True)  # the host "waits" for the failed copy: no raise
    with pytest.raises(StagingCopyError):
        flat.finish_staging()


def test_without_pinned_host_buffers_nothing_is_device_staged_and_it_is_said(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ops = HostCopyOps(needs_pinned_host=True)  # like CUDA: a drain into pageable memory would block
    try:
        stager = stager_for(ops, free=64 * MIB)  # pinned_limit_bytes=0: never pin
        state = {"w": torch.randn(64, 64), "b": torch.randn(64)}
        with caplog.at_level(logging.INFO, logger="elastic.checkpoint.staging"):
            flat = stager.flatten(state, copy=True)
        flat.finish_staging()
        assert flat.device_staged == ()
        said = [r.getMessage() for r in caplog.records if "not device-side" in r.getMessage()]
        assert len(said) == 1 and "2 of 2" in said[0]
        assert all(torch.equal(t, s) for t, s in zip(flat.tensors, state.values(), strict=True))
    finally:
        ops.close()


class PinningStager(Stager):
    """Pinning "works" on this CPU machine: the buffers are pageable tensors counted as pinned (torch refuses
    ``pin_memory=True`` without CUDA), so that with ``needs_pinned_host`` the stager takes CUDA's branches."""

    def _pin(self, src: torch.Tensor) -> torch.Tensor | None:
        nbytes = src.numel() * src.element_size()
        if nbytes == 0:
            return None  # as the real one: a zero-byte tensor gets no pinned buffer
        self._pinned_held += 1 << (nbytes - 1).bit_length()
        return torch.empty(src.shape, dtype=src.dtype)


def test_a_zero_element_tensor_is_not_said_to_lack_a_pinned_buffer(caplog: pytest.LogCaptureFixture) -> None:
    """An empty CUDA tensor has nothing to pin or stage: it once took the once-only "no pinned host buffer"
    line, saying pinning was capped under the cap, and a later real shortage went unsaid."""
    ops = HostCopyOps(needs_pinned_host=True)
    try:
        stager = PinningStager(
            pinned_limit_bytes=1 << 30, ops=ops, device_pool=DeviceBufferPool(HostDeviceMemory(64 * MIB), NO_MARGIN)
        )
        state = {"w": torch.randn(64, 64), "empty": torch.zeros(0, 3), "b": torch.randn(64)}
        with caplog.at_level(logging.INFO, logger="elastic.checkpoint.staging"):
            flat = stager.flatten(state, copy=True)
        flat.finish_staging()
        assert flat.device_staged == (0, 2)
        assert not [r.getMessage() for r in caplog.records if "not device-side" in r.getMessage()]
        assert all(torch.equal(t, s) for t, s in zip(flat.tensors, state.values(), strict=True))
    finally:
        ops.close()


def _warm_staging_cpu_seconds(ops: HostCopyOps, tensors: int) -> float:
    """The calling thread's CPU seconds (the least of 3 warm saves) to stage a state of ``tensors`` small tensors,
    all device-staged and fenced at the optimizer's step (the loop's save call)."""
    state = {f"t{i}": torch.full((4,), float(i)) for i in range(tensors)}
    stager = stager_for(ops, free=1 << 30)
    best = float("inf")
    for attempt in range(4):
        gc.disable()  # the algorithm's cost, not when the collector happens to run (the queued copies are objects)
        try:
            start = time.thread_time()  # this thread only: not the copy stream's thread, not other processes
            flat = stager.flatten(state, copy=True, defer=lambda _t: True)
            spent = time.thread_time() - start
        finally:
            gc.enable()
        flat.finish_staging()
        if attempt:  # the first save allocates every buffer
            best = min(best, spent)
    assert all(torch.equal(t, s) for t, s in zip(flat.tensors, state.values(), strict=True))
    return best


@pytest.mark.timeout(120)
def test_the_save_calls_staging_grows_linearly_with_the_number_of_tensors(ops: HostCopyOps) -> None:
    """A plan of the device buffers once rebuilt a set per held buffer (quadratic: 22 ms of the save call for 1,203
    tensors, 167 ms for 3,603, 1.4 s for 10,803, see bench/staging_cost_bench.py). Four times the tensors must cost
    well under 16 times the CPU (a linear stager: about 4)."""
    small = _warm_staging_cpu_seconds(ops, 1000)
    large = _warm_staging_cpu_seconds(ops, 4000)
    assert large < 8 * small, f"staging 1000 tensors: {small * 1e3:.1f} ms CPU, 4000 tensors: {large * 1e3:.1f} ms"


# -- the manager over in-memory copy streams --------------------------------------------------------------
def adamw_state() -> tuple[nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.Linear(64, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(16, 64)).sum().backward()
    optimizer.step()
    return model, optimizer, {"model": model.state_dict(), "optimizer": optimizer.state_dict()}


@pytest.mark.timeout(60)
def test_overlapped_device_staged_save_round_trips_and_the_writer_waits_for_the_drain(
    tmp_path: Path, ops: HostCopyOps
) -> None:
    model, optimizer, state = adamw_state()
    expected = cpu_clone(state)
    events: list[str] = []
    stager = stager_for(ops, free=64 * MIB)
    mgr = FsspecCheckpointManager(
        create_checkpoint_manager(str(tmp_path)).storage, CheckpointOptions(), events.append, stager=stager
    )
    ops.hold("drain")
    mgr.save(1, state, overlap_with=optimizer)
    model(torch.randn(16, 64)).sum().backward()
    optimizer.step()  # the fence: the device copies are done, the drain is not
    assert wait_until(lambda: "staging_begin" in events)
    time.sleep(0.2)
    assert "save_begin" not in events and mgr.in_flight  # the writer waits for the drain
    ops.release("drain")
    mgr.wait()
    assert mgr.last_device_staged_bytes > 0
    assert_same(mgr.load(1).state, expected)
    mgr.close()


class BatchCountingCopyOps(HostCopyOps):
    """Records each ``copy_all`` call: (phase, number of copies)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def copy_all(self, device: int, copies: Sequence[QueuedCopy], *, phase: Phase) -> None:
        self.calls.append((phase, len(copies)))
        super().copy_all(device, copies, phase=phase)


@pytest.mark.timeout(60)
def test_a_save_queues_its_copies_in_one_call_per_device_and_phase_not_one_per_tensor(tmp_path: Path) -> None:
    """On CUDA each call enters the device and the copy stream (a few microseconds each, twice per tensor with
    device-side staging: thousands of tensors made that tens of milliseconds of the save call)."""
    ops = BatchCountingCopyOps()
    try:
        model, optimizer, state = adamw_state()
        expected = cpu_clone(state)
        mgr = FsspecCheckpointManager(
            create_checkpoint_manager(str(tmp_path)).storage, CheckpointOptions(), stager=stager_for(ops, free=64 * MIB)
        )
        mgr.save(1, state, overlap_with=optimizer)
        model(torch.randn(16, 64)).sum().backward()
        optimizer.step()
        mgr.wait()
        staged = sum(n for phase, n in ops.calls if phase == "drain")
        assert staged >= 20 and staged == sum(n for phase, n in ops.calls if phase == "stage")
        # two groups copied (the others first, then the optimizer's, which the fence orders), then one drain of all
        assert [phase for phase, _ in ops.calls] == ["stage", "stage", "drain"], ops.calls
        assert_same(mgr.load(1).state, expected)
        mgr.close()
    finally:
        ops.close()


class SlowDeviceMemory(HostDeviceMemory):
    """Allocations take a while (pinning and cudaMalloc do): a save can arrive mid warm-up."""

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, device: int) -> torch.Tensor:
        time.sleep(0.05)
        return super().empty(shape, dtype, device)


def counted_manager(tmp_path: Path, ops: HostCopyOps, memory: HostDeviceMemory) -> FsspecCheckpointManager:
    stager = Stager(pinned_limit_bytes=0, ops=ops, device_pool=DeviceBufferPool(memory, NO_MARGIN))
    return create_checkpoint_manager(str(tmp_path), stager=stager)


@pytest.mark.timeout(60)
def test_after_prepare_the_first_save_allocates_nothing(tmp_path: Path, ops: HostCopyOps) -> None:
    model, optimizer, state = adamw_state()
    memory = HostDeviceMemory(free=64 * MIB)
    mgr = counted_manager(tmp_path, ops, memory)
    mgr.prepare(state)
    mgr._warm_up.join()
    host, device = mgr._stager.host_allocations, memory.allocations
    assert host > 0 and device > 0
    mgr.prepare(state)  # idempotent: the same tensors again start nothing
    assert not mgr._warm_up.running
    mgr.save(1, state, overlap_with=optimizer)
    mgr.wait()
    assert (mgr._stager.host_allocations, memory.allocations) == (host, device)
    assert mgr.last_device_staged_bytes == sum(t.numel() * t.element_size() for t in model.parameters()) + sum(
        t.numel() * t.element_size() for t in model.buffers()
    ) + sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values())
    mgr.close()


@pytest.mark.timeout(60)
def test_a_save_racing_the_warm_up_waits_for_it_and_is_correct(tmp_path: Path, ops: HostCopyOps) -> None:
    _model, optimizer, state = adamw_state()
    expected = cpu_clone(state)
    memory = SlowDeviceMemory(free=64 * MIB)
    mgr = counted_manager(tmp_path, ops, memory)
    mgr.prepare(state)
    assert mgr._warm_up.running
    mgr.save(1, state, overlap_with=optimizer)  # waits for the warm-up, then stages into its buffers
    mgr.wait()
    tensors = len(mgr._stager._buffers)
    assert memory.allocations == tensors  # one device buffer each: none allocated twice
    assert_same(mgr.load(1).state, expected)
    mgr.close()


@pytest.mark.timeout(60)
def test_prepare_warms_host_tensors_buffers_too(tmp_path: Path) -> None:
    _model, optimizer, state = adamw_state()  # CPU tensors, the default stager: no device path at all
    with create_checkpoint_manager(str(tmp_path)) as mgr:
        mgr.prepare(state)
        mgr.wait_prepared()
        allocated = mgr._stager.host_allocations
        assert allocated == len(mgr._stager._buffers) > 0
        mgr.save(1, state, overlap_with=optimizer)
        mgr.wait()
        assert mgr._stager.host_allocations == allocated and mgr.last_device_staged_bytes == 0


def test_manager_builds_device_staging_from_its_options(tmp_path: Path) -> None:
    options = CheckpointOptions(
        device_staging=False, device_staging_margin_bytes=MIB, device_staging_margin_fraction=0.2
    )
    with create_checkpoint_manager(str(tmp_path), options) as mgr:
        pool = mgr._stager.device_pool
        assert pool is not None
        assert pool.settings == DeviceStagingSettings(enabled=False, margin_bytes=MIB, margin_fraction=0.2)
    with create_checkpoint_manager(str(tmp_path)) as mgr:
        assert mgr._stager.device_pool is not None and mgr._stager.device_pool.settings.enabled


# -- CUDA -------------------------------------------------------------------------------------------------
def needs_cuda(test: Any) -> Any:
    """Marked ``cuda`` (``pytest -m cuda``, as scripts/gpu_check.sh runs them), skipped without CUDA."""
    return pytest.mark.cuda(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")(test))


def cuda_stager(settings: DeviceStagingSettings = NO_MARGIN) -> Stager:
    from elastic.checkpoint.device_staging import CudaDeviceMemory

    return Stager(pinned_limit_bytes=16 << 30, device_pool=DeviceBufferPool(CudaDeviceMemory(), settings))


def cuda_adamw() -> tuple[nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), nn.BatchNorm1d(512), nn.Linear(512, 64)).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cuda_step(model, optimizer)
    return model, optimizer, {"model": model.state_dict(), "optimizer": optimizer.state_dict()}


def cuda_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad()
    model(torch.randn(32, 512, device="cuda")).square().mean().backward()
    optimizer.step()


def leaves(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in leaves(v)]
    if isinstance(obj, list):
        return [t for v in obj for t in leaves(v)]
    return []


def host_clone(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: host_clone(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [host_clone(v) for v in obj]
    return obj


@needs_cuda
@pytest.mark.timeout(120)
def test_cuda_device_staged_overlapped_save_round_trips_bit_exactly(tmp_path: Path) -> None:
    model, optimizer, state = cuda_adamw()
    expected = host_clone(state)
    cuda_bytes = sum(t.numel() * t.element_size() for t in leaves(state) if t.is_cuda)
    with create_checkpoint_manager(str(tmp_path), CheckpointOptions(device_staging_margin_bytes=0)) as mgr:
        mgr.save(1, state, overlap_with=optimizer)
        for _ in range(3):
            cuda_step(model, optimizer)  # changes every saved tensor while the drain may still run
        mgr.wait()
        assert mgr.last_device_staged_bytes == cuda_bytes  # all of them (AdamW's step counts are host tensors)
        assert_same(mgr.load(1).state, expected)


@needs_cuda
@pytest.mark.timeout(120)
def test_cuda_fence_waits_for_the_device_copy_not_for_the_drain() -> None:
    state = {f"w{i}": torch.randn(64 << 20, device="cuda") for i in range(4)}  # 4 x 256 MiB
    expected = host_clone(state)
    stager = cuda_stager()
    warm = stager.flatten(state, copy=True, defer=lambda t: True)  # allocates the buffers (pinned, device)
    warm.finish_staging()
    torch.cuda.synchronize()
    for t in state.values():
        t.add_(1.0)
    expected = host_clone(state)
    flat = stager.flatten(state, copy=True, defer=lambda t: True)  # every tensor behind the fence
    assert flat.device_staged == (0, 1, 2, 3)
    fence, drain = flat.fence_events[0], flat.copy_events[0]
    fence.wait()  # what optimizer.step() would be ordered after: the device-to-device copies
    assert not drain.query(), "the 1 GiB device-to-host drain finished with the device-to-device copy"
    flat.fence()
    for t in state.values():
        t.mul_(-3.0)  # the next step may change the sources now: the device buffers hold the snapshot
    flat.finish_staging()
    assert drain.query()
    for got, want in zip(flat.tensors, expected.values(), strict=True):
        assert torch.equal(got, want)


@needs_cuda
@pytest.mark.timeout(120)
def test_cuda_a_margin_forces_a_per_tensor_fallback(caplog: pytest.LogCaptureFixture) -> None:
    size = 64 << 20  # bytes per tensor
    state = {f"w{i}": torch.randn(size // 4, device="cuda") for i in range(3)}
    expected = host_clone(state)
    free, _total = torch.cuda.mem_get_info()
    settings = DeviceStagingSettings(margin_bytes=max(0, free - size - size // 2), margin_fraction=0.0)
    stager = cuda_stager(settings)
    with caplog.at_level(logging.INFO, logger=DEVICE_LOGGER):
        flat = stager.flatten(state, copy=True)
    assert flat.device_staged == (0,)  # room for one: the first, the others straight to the host
    assert any("mixed" in r.getMessage() for r in caplog.records)
    flat.finish_staging()
    for got, want in zip(flat.tensors, expected.values(), strict=True):
        assert torch.equal(got, want)


@needs_cuda
@pytest.mark.timeout(120)
def test_cuda_after_prepare_the_first_save_allocates_nothing(tmp_path: Path) -> None:
    _model, optimizer, state = cuda_adamw()
    with create_checkpoint_manager(str(tmp_path), CheckpointOptions(device_staging_margin_bytes=0)) as mgr:
        mgr.prepare(state)
        mgr.wait_prepared()
        pool = mgr._stager.device_pool
        assert pool is not None and pool.held_bytes > 0 and mgr._stager.pinned_bytes > 0
        host, device = mgr._stager.host_allocations, pool.held_bytes
        mgr.save(1, state, overlap_with=optimizer)
        mgr.wait()
        assert (mgr._stager.host_allocations, pool.held_bytes) == (host, device)


@needs_cuda
def test_cuda_free_memory_is_capped_by_the_per_process_memory_fraction() -> None:
    from elastic.checkpoint.device_staging import CudaDeviceMemory

    device = torch.cuda.current_device()
    before = torch.cuda.get_per_process_memory_fraction(device)
    total = torch.cuda.mem_get_info(device)[1]
    try:
        torch.cuda.set_per_process_memory_fraction(0.05, device)
        free, reported_total = CudaDeviceMemory().mem_info(device)
        assert reported_total == total
        assert free <= 0.05 * total - torch.cuda.memory_reserved(device) + 1
        plan = DeviceBufferPool(CudaDeviceMemory(), NO_MARGIN).ensure(
            [StageRequest(0, device, (total // 8,), torch.uint8)]
        )
        assert plan.direct == (0,), "an eighth of the device does not fit a twentieth of it"
    finally:
        torch.cuda.set_per_process_memory_fraction(before, device)
