"""Staging: reused host buffers, pinned buffers and a copy stream for CUDA tensors, and the optimizer fence.

CPU tests run everywhere; the CUDA ones need a GPU and skip cleanly without one.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
from torch import nn

from elastic.checkpoint import CheckpointOptions, CheckpointWriteError, create_checkpoint_manager
from elastic.checkpoint.staging import Stager
from elastic.checkpoint.storage import BinaryWriter, CheckpointStorage, LocalStorage
from tests.elastic.checkpoint._helpers import assert_same

STAGING_LOGGER = "elastic.checkpoint.staging"
T = TypeVar("T", bound=Callable[..., object])


def needs_cuda(test: T) -> T:
    """A CUDA test: marked ``cuda`` (``pytest -m cuda``, as scripts/gpu_check.sh runs them), skipped without CUDA."""
    return pytest.mark.cuda(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")(test))


def cpu_clone(obj: Any) -> Any:
    """A deep copy with every tensor cloned to CPU (what a snapshot of ``obj`` taken now must hold)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return type(obj)((k, cpu_clone(v)) for k, v in obj.items())
    if isinstance(obj, list):
        return [cpu_clone(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(cpu_clone(v) for v in obj)
    return obj


class TiedModel(nn.Module):
    """Embedding tied to the output layer, BatchNorm statistics: shared and non-optimizer tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.norm = nn.BatchNorm1d(32)
        self.hidden = nn.Linear(32, 32)
        self.out = nn.Linear(32, 64, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(self.norm(self.embed(ids)))))


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, device: str) -> None:
    optimizer.zero_grad()
    ids = torch.randint(0, 64, (16,), device=device)
    nn.functional.cross_entropy(model(ids), ids).backward()
    optimizer.step()


def model_and_adamw(device: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = TiedModel().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        train_step(model, optimizer, device)
    return model, optimizer


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer, device: str) -> dict[str, Any]:
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "extras": {
            "transposed": torch.arange(12.0, device=device).reshape(3, 4).t(),  # non-contiguous
            "empty": torch.zeros(0, 3, device=device),
            "rng": torch.get_rng_state(),
        },
    }


# -- CPU --------------------------------------------------------------------------------------------------
def test_buffers_are_reused_across_saves_and_reallocated_when_shapes_change() -> None:
    stager = Stager(pinned_limit_bytes=1 << 30)
    state = {"a": torch.randn(64, 8), "b": torch.arange(10), "c": torch.randn(3)}
    first = stager.flatten(state, copy=True)
    first.finish_staging()
    ptrs = [t.data_ptr() for t in first.tensors]
    assert all(t.data_ptr() != s.data_ptr() for t, s in zip(first.tensors, state.values(), strict=True))

    state["a"].add_(1.0)
    second = stager.flatten(state, copy=True)
    second.finish_staging()
    assert [t.data_ptr() for t in second.tensors] == ptrs
    assert all(torch.equal(t, s) for t, s in zip(second.tensors, state.values(), strict=True))

    state["b"] = torch.arange(20)  # new shape: a new buffer for it, the others kept
    third = stager.flatten(state, copy=True)
    assert third.tensors[1].data_ptr() != ptrs[1]
    assert [third.tensors[0].data_ptr(), third.tensors[2].data_ptr()] == [ptrs[0], ptrs[2]]
    assert all(torch.equal(t, s) for t, s in zip(third.tensors, state.values(), strict=True))


def test_cpu_tensors_are_staged_in_pageable_memory_whatever_the_pin_cap(caplog: pytest.LogCaptureFixture) -> None:
    state = {"w": torch.randn(256, 256), "b": torch.randn(256)}
    for cap in (0, 16 << 30):
        stager = Stager(pinned_limit_bytes=cap)
        with caplog.at_level(logging.WARNING, logger=STAGING_LOGGER):
            flat = stager.flatten(state, copy=True)
        assert stager.pinned_bytes == 0
        assert not any(t.is_pinned() for t in flat.tensors)
        assert not flat.copy_events and not flat.fence_events
    assert not caplog.records


def test_manager_passes_its_pin_cap_to_the_stager(tmp_path: Path) -> None:
    with create_checkpoint_manager(str(tmp_path), CheckpointOptions(pinned_staging_bytes=0)) as mgr:
        assert mgr._stager._pinned_limit == 0
    with create_checkpoint_manager(str(tmp_path)) as mgr:
        assert mgr._stager._pinned_limit == CheckpointOptions().pinned_staging_bytes


@pytest.mark.timeout(60)
def test_overlapped_cpu_save_holds_save_time_values_though_adamw_steps_at_once(tmp_path: Path) -> None:
    model, optimizer = model_and_adamw("cpu")
    state = full_state(model, optimizer, "cpu")
    expected = cpu_clone(state)
    with create_checkpoint_manager(str(tmp_path)) as mgr:
        mgr.save(3, state, overlap_with=optimizer)
        for _ in range(3):  # no waiting: the fence alone keeps the snapshot consistent
            train_step(model, optimizer, "cpu")
        mgr.wait()
        snap = mgr.load_latest()
    assert snap is not None
    assert_same(snap.state, expected)
    assert not torch.equal(model.hidden.weight, expected["model"]["hidden.weight"])
    assert not torch.equal(model.norm.running_mean, expected["model"]["norm.running_mean"])


class FailingWrites(CheckpointStorage):
    """Our storage interface over a local directory, whose data writes fail (a full or broken disk)."""

    def __init__(self, root: Path) -> None:
        self.inner = LocalStorage(root)

    @property
    def url(self) -> str:
        return self.inner.url

    def prepare_root(self) -> None:
        self.inner.prepare_root()

    def make_dirs(self, rel: str) -> None:
        self.inner.make_dirs(rel)

    @contextlib.contextmanager
    def open_write(self, rel: str) -> Iterator[BinaryWriter]:
        raise OSError(28, "No space left on device")
        yield  # pragma: no cover

    def publish(self, rel: str, data: bytes) -> None:
        self.inner.publish(rel, data)

    def open_read(self, rel: str) -> Any:
        return self.inner.open_read(rel)

    def read_bytes(self, rel: str) -> bytes:
        return self.inner.read_bytes(rel)

    def list_sizes(self, prefix: str = "") -> dict[str, int]:
        return self.inner.list_sizes(prefix)

    def list_children(self, prefix: str = "") -> list[str]:
        return self.inner.list_children(prefix)

    def delete_file(self, rel: str) -> None:
        self.inner.delete_file(rel)

    def delete_tree(self, rel: str) -> None:
        self.inner.delete_tree(rel)

    def full_path(self, rel: str) -> str:
        return self.inner.full_path(rel)


def step_in_thread(model: nn.Module, optimizer: torch.optim.Optimizer) -> bool:
    """Whether a training step finishes within 10 s (a fence stuck on a failed save never would)."""
    stepper = threading.Thread(target=train_step, args=(model, optimizer, "cpu"), daemon=True)
    stepper.start()
    stepper.join(10)
    return not stepper.is_alive()


@pytest.mark.timeout(60)
def test_fence_is_released_after_a_failed_save(tmp_path: Path) -> None:
    model, optimizer = model_and_adamw("cpu")
    mgr = create_checkpoint_manager(str(tmp_path), storage=FailingWrites(tmp_path))
    mgr.save(1, full_state(model, optimizer, "cpu"), overlap_with=optimizer)
    assert step_in_thread(model, optimizer)
    with pytest.raises(CheckpointWriteError, match=r"step 1 .*No space left"):
        mgr.wait()
    assert step_in_thread(model, optimizer)
    mgr.close()


@pytest.mark.timeout(60)
def test_fence_is_released_when_a_save_fails_before_its_deferred_copies(tmp_path: Path) -> None:
    def fail_before_copying(name: str) -> None:
        if name == "staging_begin":
            raise RuntimeError("writer died before staging")

    model, optimizer = model_and_adamw("cpu")
    mgr = create_checkpoint_manager(str(tmp_path), events=fail_before_copying)
    mgr.save(1, full_state(model, optimizer, "cpu"), overlap_with=optimizer)
    assert step_in_thread(model, optimizer)
    with pytest.raises(CheckpointWriteError, match="writer died before staging"):
        mgr.wait()
    mgr.close()


# -- CUDA -------------------------------------------------------------------------------------------------
def queue_long_gpu_work(seconds: float = 1.0) -> torch.Tensor:
    """Queue about ``seconds`` of matmuls on the current stream; returns their (pending) result."""
    a = torch.randn(4096, 4096, device="cuda")
    b = a @ a  # warm-up (cuBLAS start-up), not measured
    torch.cuda.synchronize()
    probe = torch.cuda.Event(enable_timing=True)
    probe_end = torch.cuda.Event(enable_timing=True)
    probe.record()
    for _ in range(5):
        b = (a @ b) * 1e-4
    probe_end.record()
    probe_end.synchronize()
    count = max(10, int(seconds * 1000 * 5 / max(probe.elapsed_time(probe_end), 1e-3)))
    for _ in range(count):
        b = (a @ b) * 1e-4
    return b


@needs_cuda
@pytest.mark.timeout(120)
def test_cuda_adamw_snapshot_equals_pre_step_values_though_the_optimizer_steps_at_once(tmp_path: Path) -> None:
    model, optimizer = model_and_adamw("cuda")
    state = full_state(model, optimizer, "cuda")
    expected = cpu_clone(state)
    with create_checkpoint_manager(str(tmp_path)) as mgr:
        mgr.save(3, state, overlap_with=optimizer)
        for _ in range(3):
            train_step(model, optimizer, "cuda")
        mgr.wait()
        snap = mgr.load_latest()
        assert mgr._stager.pinned_bytes > 0
    assert snap is not None
    assert_same(snap.state, expected)
    assert not torch.equal(model.hidden.weight.cpu(), expected["model"]["hidden.weight"])


@needs_cuda
@pytest.mark.timeout(120)
def test_cuda_batchnorm_statistics_snapshot_holds_save_time_values_though_the_next_forward_changes_them(
    tmp_path: Path,
) -> None:
    model, optimizer = model_and_adamw("cuda")
    state = full_state(model, optimizer, "cuda")
    expected = cpu_clone(state)
    with create_checkpoint_manager(str(tmp_path)) as mgr:
        queue_long_gpu_work(0.5)  # the copies cannot have run before the forward below is queued
        mgr.save(3, state, overlap_with=optimizer)
        model(torch.randint(0, 64, (16,), device="cuda")).sum().backward()  # updates running stats
        optimizer.step()
        mgr.wait()
        snap = mgr.load_latest()
    assert snap is not None
    assert not torch.equal(model.norm.running_mean.cpu(), expected["model"]["norm.running_mean"])
    assert_same(snap.state["model"]["norm.running_mean"], expected["model"]["norm.running_mean"])
    assert_same(snap.state["model"]["norm.running_var"], expected["model"]["norm.running_var"])
    assert_same(snap.state, expected)


@needs_cuda
@pytest.mark.timeout(120)
def test_cuda_staging_buffers_are_pinned_and_reused(tmp_path: Path) -> None:
    stager = Stager(pinned_limit_bytes=1 << 30)
    state = {"w": torch.randn(512, 512, device="cuda"), "t": torch.randn(64, 32, device="cuda").t()}
    first = stager.flatten(state, copy=True)
    first.finish_staging()
    assert all(t.device.type == "cpu" and t.is_pinned() and t.is_contiguous() for t in first.tensors)
    assert [torch.equal(t, s.cpu()) for t, s in zip(first.tensors, state.values(), strict=True)] == [True, True]
    state["w"].mul_(2.0)
    second = stager.flatten(state, copy=True)
    second.finish_staging()
    assert [t.data_ptr() for t in second.tensors] == [t.data_ptr() for t in first.tensors]
    assert torch.equal(second.tensors[0], state["w"].cpu())
    assert stager.pinned_bytes >= sum(s.numel() * s.element_size() for s in state.values())

    with create_checkpoint_manager(str(tmp_path)) as mgr:  # a blocking save stages through them too
        mgr.save(1, state, blocking=True)
        snap = mgr.load(1)
    assert_same(snap.state, cpu_clone(state))


@needs_cuda
@pytest.mark.timeout(120)
def test_cuda_save_and_the_next_optimizer_step_return_without_waiting_for_the_gpu(tmp_path: Path) -> None:
    model, optimizer = model_and_adamw("cuda")
    state = full_state(model, optimizer, "cuda")
    with create_checkpoint_manager(str(tmp_path)) as mgr:
        mgr.save(1, state, blocking=True)  # buffers allocated and pinned: the next save only copies
        queue_long_gpu_work(2.0)
        with torch.no_grad():
            model.hidden.bias.fill_(7.0)  # queued after the long work: the snapshot must hold it
        expected = cpu_clone(state)  # (synchronizes, before the marker is queued)
        queue_long_gpu_work(2.0)
        marker = torch.cuda.Event()
        marker.record()
        mgr.save(2, state, overlap_with=optimizer)
        assert not marker.query(), "save waited for the GPU work queued before it"
        train_step(model, optimizer, "cuda")
        assert not marker.query(), "the optimizer fence waited on the host"
        mgr.wait()
        snap = mgr.load(2)
    assert_same(snap.state, expected)
    assert bool((snap.state["model"]["hidden.bias"] == 7.0).all())


@needs_cuda
@pytest.mark.timeout(120)
def test_cuda_pin_cap_exceeded_falls_back_to_pageable_memory_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state = {f"w{i}": torch.randn(1024, 1024, device="cuda") for i in range(4)}  # 4 MiB each
    options = CheckpointOptions(pinned_staging_bytes=9 << 20)  # room for two
    with (
        caplog.at_level(logging.WARNING, logger=STAGING_LOGGER),
        create_checkpoint_manager(str(tmp_path), options) as mgr,
    ):
        for step in (1, 2):
            state["w0"].add_(1.0)
            mgr.save(step, state)
            mgr.wait()
        snap = mgr.load(2)
        buffers = [b.tensor for b in mgr._stager._buffers if b is not None]
    assert [t.is_pinned() for t in buffers] == [True, True, False, False]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "pinned_staging_bytes" in warnings[0].getMessage() and "pageable" in warnings[0].getMessage()
    assert_same(snap.state, cpu_clone(state))


@needs_cuda
def test_cuda_zero_pin_cap_stages_in_pageable_memory(caplog: pytest.LogCaptureFixture) -> None:
    stager = Stager(pinned_limit_bytes=0)
    state = {"w": torch.randn(256, 256, device="cuda")}
    with caplog.at_level(logging.WARNING, logger=STAGING_LOGGER):
        flat = stager.flatten(state, copy=True)
        flat.finish_staging()
    assert not flat.tensors[0].is_pinned() and stager.pinned_bytes == 0
    assert torch.equal(flat.tensors[0], state["w"].cpu())
    assert not caplog.records


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.timeout(120)
def test_cuda_tensors_on_two_devices_are_staged_and_fenced_per_device(tmp_path: Path) -> None:
    params = [nn.Parameter(torch.randn(256, 256, device=f"cuda:{d}")) for d in (0, 1)]
    optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()
    state = {"params": list(params), "optimizer": optimizer.state_dict()}
    expected = cpu_clone(state)
    with create_checkpoint_manager(str(tmp_path)) as mgr:
        mgr.save(1, state, overlap_with=optimizer)
        started = time.perf_counter()
        optimizer.step()
        assert time.perf_counter() - started < 5
        mgr.wait()
        snap = mgr.load(1)
    assert_same(snap.state, expected)
