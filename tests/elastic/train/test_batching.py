"""elastic/train/batching.py: a micro-batch collated and moved to the training device; on a GPU, a batch in pageable
host memory is pinned first, so that its copy is queued behind the device's work instead of waiting for it."""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import pytest
import torch
from torch.utils.data import default_collate

from elastic.train.batching import make_batch, to_device

pytestmark = pytest.mark.timeout(60)
_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; torch.cuda.is_available() is False")


def test_a_batch_for_the_cpu_is_the_collated_batch_itself() -> None:
    data = [torch.full((2,), float(i)) for i in range(6)]
    batch = make_batch(data, [4, 1], torch.stack, torch.device("cpu"))
    assert torch.equal(batch, torch.tensor([[4.0, 4.0], [1.0, 1.0]]))
    nested: dict[str, Any] = {"x": batch, "ids": [batch[0]], "name": "a"}
    assert to_device(nested, torch.device("cpu")) is nested


@pytest.mark.cuda
@_CUDA
def test_on_a_gpu_nested_batches_arrive_whole_and_on_the_device() -> None:
    device = torch.device("cuda", 0)
    batch = {"x": torch.randn(4, 3), "pair": (torch.arange(5), [torch.ones(2, dtype=torch.bool)]), "name": "a"}
    moved = to_device(batch, device)
    torch.cuda.synchronize()
    assert moved["x"].device == device and moved["pair"][0].device == device and moved["pair"][1][0].is_cuda
    assert isinstance(moved["pair"], tuple) and isinstance(moved["pair"][1], list) and moved["name"] == "a"
    assert torch.equal(moved["x"].cpu(), batch["x"]) and torch.equal(moved["pair"][0].cpu(), batch["pair"][0])
    assert not batch["x"].is_pinned(), "the caller's tensor is left as it was"


@pytest.mark.cuda
@_CUDA
def test_on_a_gpu_a_pageable_batch_is_queued_behind_the_devices_work_not_waited_for() -> None:
    """64 MiB of pageable host memory while ~1 s of work is queued on the stream: the host returns long before the
    device is done (a pageable non_blocking copy that large waits for the queue)."""
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    batch = torch.randn(16, 1024, 1024)  # 64 MiB, pageable
    to_device(batch, device)  # warm: the pinned block is allocated once, then reused from torch's cache
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU clock cycles, queued on the current stream
    start = time.perf_counter()
    moved = to_device(batch, device)
    host_s = time.perf_counter() - start
    torch.cuda.synchronize()
    total_s = time.perf_counter() - start
    assert total_s > 0.3, f"the queued work took {total_s:.3f} s: too little to tell waiting from queueing"
    assert host_s < 0.5 * total_s, f"the host waited {host_s:.3f} s of the device's {total_s:.3f} s"
    assert torch.equal(moved.cpu(), batch)


class _Pair(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


def test_a_batch_for_another_device_keeps_its_structure_namedtuples_included() -> None:
    """The walk every non-CPU batch takes (the "meta" device stands in for a GPU): ``default_collate`` keeps a
    dataset's namedtuples, whose constructor takes fields, not one iterable."""
    data = [_Pair(torch.full((2,), float(i)), torch.tensor(i)) for i in range(4)]
    batch = make_batch(data, [3, 0], default_collate, torch.device("meta"))
    assert isinstance(batch, _Pair) and batch.x.is_meta and batch.y.is_meta
    assert batch.x.shape == (2, 2) and batch.y.shape == (2,)
    nested = to_device(
        {"p": _Pair(torch.ones(1), torch.zeros(1)), "l": [torch.ones(3)], "t": (1, "a")}, torch.device("meta")
    )
    assert isinstance(nested["p"], _Pair) and nested["p"].y.is_meta and nested["l"][0].is_meta
    assert nested["t"] == (1, "a")
