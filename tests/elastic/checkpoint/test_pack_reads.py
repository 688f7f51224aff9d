"""A pack snapshot read back into one allocation per tensor (elastic/checkpoint/codec.py, file_reads.py): every
restored tensor owns its memory, so what a resumed run keeps (the optimizer's state) does not keep the rest of
the snapshot (the model weights' bytes, copied into the parameters) allocated; the skeleton's table is checked
before any byte is placed; small and large tensors, across chunk and segment boundaries, come back bit-identical."""

from __future__ import annotations

import gc
import io
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic.checkpoint import CheckpointOptions, create_checkpoint_manager
from elastic.checkpoint.codec import PACK_FORMAT, PackDecodeError, read_skeleton
from tests.elastic.checkpoint._helpers import assert_same, cuda_only, make_state

pytestmark = pytest.mark.timeout(120)


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def _mixed_state() -> dict[str, Any]:
    """Many small tensors of every width between large ones, 0-dimensional and empty ones, and a tied pair."""
    gen = torch.Generator().manual_seed(7)
    dtypes = [torch.float32, torch.bfloat16, torch.int8, torch.bool, torch.complex64, torch.float16, torch.int64]
    small = [(torch.randn(n % 37 + 1, generator=gen) * 50).to(dtypes[n % len(dtypes)]) for n in range(120)]
    tied = torch.randn(5, 3, generator=gen)
    return {
        "large": torch.randn(300, 1024, generator=gen),  # 1.2 MB: read straight into its memory
        "small": small,
        "between": torch.randn(70_000, generator=gen),  # 280 kB, then more small ones
        "tail": [torch.tensor(float(i)) for i in range(5)] + [torch.empty(0, 4), torch.zeros(0, dtype=torch.int8)],
        "tied": [tied, tied],
        "step": torch.tensor(41.0),
    }


@pytest.mark.parametrize(
    "settings",
    [
        {"segment_bytes": 64 << 10, "chunk_bytes": 4096, "io_threads": 3},  # tensors cut by chunks and segments
        {"chunk_bytes": 1 << 20},  # chunks spanning many small tensors, large ones read in place
    ],
    ids=["small-chunks-and-segments", "large-chunks"],
)
def test_small_and_large_tensors_come_back_bit_identical_each_with_memory_of_its_own(
    tmp_path: Path, settings: dict[str, Any]
) -> None:
    state = _mixed_state()
    with create_checkpoint_manager(str(tmp_path), CheckpointOptions(**settings)) as mgr:
        mgr.save(3, state, blocking=True)
        loaded = mgr.load(3).state
    assert_same(loaded, state)
    assert loaded["tied"][0] is loaded["tied"][1], "a tensor saved twice comes back as one"
    for t in _tensors(loaded):  # exactly its own bytes (a view of one buffer for all would have the buffer's)
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), (t.dtype, t.shape)


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_dropping_the_rest_of_a_loaded_state_frees_its_memory_while_one_tensor_is_kept(tmp_path: Path) -> None:
    """64 MiB of weights beside a small tensor that is kept (as a resumed optimizer keeps its state): once the
    rest of the snapshot is dropped, the weights' memory goes back to the system (an allocation that large is
    its own mapping), instead of staying for as long as the kept tensor lives."""
    state = {"weights": torch.randn(16 << 20), "moments": torch.randn(1024)}
    with create_checkpoint_manager(str(tmp_path), CheckpointOptions()) as mgr:
        mgr.save(1, state, blocking=True)
        snap = mgr.load(1)
    kept = snap.state["moments"]
    before = _resident_bytes()
    del snap
    gc.collect()
    freed = before - _resident_bytes()
    assert freed > 48 << 20, f"dropping 64 MiB of weights freed {freed >> 20} MiB"
    assert torch.equal(kept, state["moments"])


@cuda_only
def test_on_a_gpu_a_resumed_model_and_optimizer_hold_no_more_device_memory_than_before_the_restart(
    tmp_path: Path,
) -> None:
    """The resume path on a GPU: a snapshot loaded into the device, the weights copied into the model, the
    optimizer's state kept as loaded (``load_state_dict`` keeps a tensor already on its parameter's device and
    dtype). Once the snapshot is dropped, nothing of the weights' 16 MiB of loaded bytes stays allocated."""
    torch.cuda.set_device(0)
    model = torch.nn.Linear(2048, 2048).cuda()  # 16 MiB of weights, 32 MiB of AdamW moments
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 2048, device="cuda")).sum().backward()
    optimizer.step()
    with create_checkpoint_manager(str(tmp_path), CheckpointOptions()) as mgr:
        mgr.save(1, {"model": model.state_dict(), "optimizer": optimizer.state_dict()}, blocking=True)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        snap = mgr.load(1, device="cuda")
    resumed = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.load_state_dict(snap.state["model"])
    resumed.load_state_dict(snap.state["optimizer"])
    kept = [v for s in resumed.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.is_cuda]
    assert kept and any(k is v for k in kept for v in _tensors(snap.state["optimizer"])), "kept as loaded"
    del optimizer, snap
    gc.collect()
    torch.cuda.synchronize()
    grown = torch.cuda.memory_allocated() - before
    assert grown <= 1 << 20, f"{grown / 2**20:.1f} MiB more device memory after the resume"


def test_a_load_into_another_device_puts_each_tensor_there_and_scalars_on_the_cpu(tmp_path: Path) -> None:
    """The "meta" device stands in for an accelerator without a path of its own: the host tensors are copied over
    one by one; 0-dimensional ones (an optimizer's step counters) stay on the CPU with their values."""
    state = {"w": torch.randn(4, 3), "step": torch.tensor(7.5), "flag": torch.tensor(True), "n": torch.tensor(-3)}
    with create_checkpoint_manager(str(tmp_path), CheckpointOptions()) as mgr:
        mgr.save(1, state, blocking=True)
        loaded = mgr.load(1, device="meta").state
    assert loaded["w"].is_meta and loaded["w"].shape == (4, 3) and loaded["w"].dtype == torch.float32
    for key in ("step", "flag", "n"):
        assert loaded[key].device.type == "cpu" and loaded[key].dim() == 0
        assert_same(loaded[key], state[key])


def _skeleton(table: list[dict[str, Any]], total: int, structure: Any = None) -> bytes:
    buf = io.BytesIO()
    bundle = {"format": PACK_FORMAT, "byteorder": sys.byteorder, "tensors": table, "tensors_bytes": total}
    torch.save({**bundle, "skeleton": structure}, buf)
    return buf.getvalue()


def _entry(offset: int, n: int, dtype: str = "float32") -> dict[str, Any]:
    return {"dtype": dtype, "shape": [n], "offset": offset, "nbytes": n * (8 if dtype == "int64" else 4)}


@pytest.mark.parametrize(
    ("table", "total", "message"),
    [
        ([_entry(0, 16), _entry(32, 4)], 48, "does not follow"),  # overlapping the one before
        ([_entry(0, 16), _entry(128, 4)], 144, "does not follow"),  # a gap longer than alignment padding
        ([_entry(0, 15), _entry(61, 4)], 77, "does not follow"),  # not 64-byte aligned
        ([{**_entry(0, 16), "nbytes": 60}], 60, "cannot have 60 bytes"),
        ([_entry(0, 16)], 128, "covers 64 bytes, the skeleton says 128"),
        ([{**_entry(0, 16), "dtype": "no_such_type"}], 64, "unknown dtype"),
        ([{"dtype": "float32"}], 64, "malformed"),
    ],
    ids=["overlap", "gap", "misaligned", "bytes-for-shape", "short-table", "dtype", "malformed"],
)
def test_a_table_that_does_not_describe_one_aligned_stream_is_refused(
    table: list[dict[str, Any]], total: int, message: str
) -> None:
    with pytest.raises(PackDecodeError, match=message):
        read_skeleton(_skeleton(table, total))


def test_a_table_as_the_writer_lays_it_out_is_read_with_empty_tensors_anywhere() -> None:
    table = [_entry(0, 0), _entry(0, 3), _entry(64, 0), _entry(64, 2, "int64")]
    skeleton = read_skeleton(_skeleton(table, 80, {"a": 1}))
    assert [t.offset for t in skeleton.tensors] == [0, 0, 64, 64] and skeleton.total == 80
    assert skeleton.structure == {"a": 1} and skeleton.tensors[3].dtype == torch.int64


def test_a_reference_to_a_tensor_not_in_the_table_is_a_load_error() -> None:
    from elastic.checkpoint.codec import TENSOR_REF_KEY, allocate_tensors, rebuild_state

    skeleton = read_skeleton(_skeleton([_entry(0, 2)], 8, {"w": {TENSOR_REF_KEY: 3}}))
    with pytest.raises(PackDecodeError, match="reference 3 is not in the table of 1"):
        rebuild_state(skeleton, allocate_tensors(skeleton, torch.device("cpu")), torch.device("cpu"))


def test_a_state_of_no_tensors_and_the_test_state_round_trip(tmp_path: Path) -> None:
    with create_checkpoint_manager(str(tmp_path), CheckpointOptions()) as mgr:
        mgr.save(1, {"epoch": 3, "names": ["a"]}, blocking=True)
        mgr.save(2, make_state(2, rows=30, cols=40), blocking=True)
        assert mgr.load(1).state == {"epoch": 3, "names": ["a"]}
        assert_same(mgr.load(2).state, make_state(2, rows=30, cols=40))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs pinned memory to be refused, as a CPU-only torch does")
def test_a_load_to_the_device_reads_through_pageable_buffers_where_pinned_memory_is_refused(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The device sink's host buffers: where cudaHostAlloc fails (a locked-memory cap) the load goes on, through
    pageable buffers, with one warning (a CPU-only torch refuses pinning the same way)."""
    from elastic.checkpoint.file_reads import DeviceSink

    monkeypatch.setattr(DeviceSink, "_pinning_warned", False)
    with caplog.at_level("WARNING", logger="elastic.checkpoint.file_reads"):
        buffers = [DeviceSink._host_buffer(1 << 16) for _ in range(3)]
    assert all(b.numel() == 1 << 16 and b.dtype == torch.uint8 and not b.is_pinned() for b in buffers)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "pinned host memory unavailable" in warnings[0]
