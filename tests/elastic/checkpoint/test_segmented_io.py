"""Tensor data in segment files written and read in parallel: round trips, per-segment verification, write
failures that leave nothing behind, old single-file snapshots, and loads straight into a CUDA device."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic.checkpoint import (
    CheckpointCorruptError,
    CheckpointOptions,
    CheckpointWriteError,
    create_checkpoint_manager,
)
from elastic.checkpoint.codec import encode_skeleton, tensor_layout
from elastic.checkpoint.layout import FileEntry, Manifest, SnapshotKind, manifest_path, step_dir
from elastic.checkpoint.reader import read_manifest, verify_files
from elastic.checkpoint.staging import Stager
from elastic.checkpoint.storage import BinaryWriter, LocalStorage
from tests.elastic.checkpoint._helpers import assert_same, cuda_only, flip_byte, make_state
from tests.elastic.checkpoint.conftest import Target

SEGMENT = 64 << 10
SMALL_SEGMENTS = {"segment_bytes": SEGMENT, "chunk_bytes": 4096, "io_threads": 3}
SHAPE = {"rows": 200, "cols": 300}  # 240 KB of float32 weights + bias + counts: 4 segments of 64 KiB


def options(**extra: Any) -> CheckpointOptions:
    return CheckpointOptions(**{**SMALL_SEGMENTS, **extra})


def save_steps(url: str, steps: list[int], **extra: Any) -> None:
    with create_checkpoint_manager(url, options(**extra)) as mgr:
        for step in steps:
            mgr.save(step, make_state(step, **SHAPE), blocking=True)


def segment_files(root: Path, step: int) -> list[Path]:
    return sorted((root / step_dir(step)).glob("*/tensors-*.bin"))


def unusable_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "unusable" in r.getMessage()]


def io_threads_alive() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("checkpoint-io")]


@pytest.mark.timeout(120)
def test_multi_segment_save_round_trips_bit_identically_with_one_manifest_entry_per_segment(target: Target) -> None:
    state = make_state(7, **SHAPE)
    flat = Stager().flatten(state, copy=False)
    _table, total = tensor_layout(flat.tensors)
    opts = options(storage_options=target.storage_options)
    with create_checkpoint_manager(target.url, opts) as mgr:
        mgr.save(7, state)  # background: the writer thread drives the pool
        mgr.wait()
    with create_checkpoint_manager(target.url, opts) as mgr:
        snap = mgr.load_latest()
        listed = mgr.storage.list_sizes(step_dir(7))
    assert snap is not None and snap.step == 7
    assert_same(snap.state, state)
    names = [f.path.split("/", 1)[1] for f in snap.manifest.files]
    segments = [f for f in snap.manifest.files if "/tensors-" in f.path]
    assert names == ["skeleton.pt"] + [f"tensors-{i:05d}.bin" for i in range(len(segments))]
    assert len(segments) == -(-total // SEGMENT) == 4
    assert [f.size for f in segments[:-1]] == [SEGMENT] * 3 and 0 < segments[-1].size <= SEGMENT
    assert sum(f.size for f in segments) == total
    assert len({f.digest for f in segments}) == len(segments)  # a hash of each segment, not of the whole
    assert {k: v for k, v in listed.items() if k != "manifest.json"} == {f.path: f.size for f in snap.manifest.files}
    assert io_threads_alive() == []


def test_a_state_smaller_than_a_segment_is_one_segment_and_an_empty_one_too(tmp_path: Path) -> None:
    with create_checkpoint_manager(str(tmp_path), CheckpointOptions()) as mgr:
        mgr.save(1, make_state(1, 8, 8), blocking=True)
        mgr.save(2, {"note": "no tensors", "n": 3}, blocking=True)
        one, empty = mgr.load(1), mgr.load(2)
    assert [f.path.split("/")[1] for f in one.manifest.files] == ["skeleton.pt", "tensors-00000.bin"]
    assert [(f.path.split("/")[1], f.size) for f in empty.manifest.files][1] == ("tensors-00000.bin", 0)
    assert_same(one.state, make_state(1, 8, 8))
    assert empty.state == {"note": "no tensors", "n": 3}


@pytest.mark.parametrize("which", ["first", "middle", "last", "skeleton"])
def test_a_flipped_byte_in_any_segment_or_the_skeleton_fails_verification_and_load_falls_back(
    which: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    save_steps(str(tmp_path), [1, 2])
    segments = segment_files(tmp_path, 2)
    assert len(segments) == 4
    victim = {
        "first": segments[0],
        "middle": segments[2],
        "last": segments[-1],
        "skeleton": next((tmp_path / step_dir(2)).glob("*/skeleton.pt")),
    }[which]
    flip_byte(victim, 0.7)
    storage = LocalStorage(tmp_path)
    with pytest.raises(CheckpointCorruptError, match=f"blake3 mismatch in .*/{victim.name}"):
        verify_files(storage, read_manifest(storage, 2), 4096, io_threads=3)
    with caplog.at_level(logging.WARNING), create_checkpoint_manager(str(tmp_path), options()) as mgr:
        with pytest.raises(CheckpointCorruptError, match=f"blake3 mismatch in .*/{victim.name}"):
            mgr.load(2)
        snap = mgr.load_latest()
    assert snap is not None and snap.step == 1
    assert_same(snap.state, make_state(1, **SHAPE))
    (warning,) = unusable_warnings(caplog)
    assert "step 2" in warning and victim.name in warning


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_a_truncated_or_missing_segment_is_caught(
    damage: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    save_steps(str(tmp_path), [1, 2])
    victim = segment_files(tmp_path, 2)[1]
    if damage == "truncated":
        victim.write_bytes(victim.read_bytes()[:-1])
    else:
        victim.unlink()
    with caplog.at_level(logging.WARNING), create_checkpoint_manager(str(tmp_path), options()) as mgr:
        with pytest.raises(CheckpointCorruptError, match=victim.name):
            mgr.load(2)
        snap = mgr.load_latest()
    assert snap is not None and snap.step == 1
    (warning,) = unusable_warnings(caplog)
    expected = "manifest says" if damage == "truncated" else "is missing"
    assert victim.name in warning and expected in warning


def test_a_segment_dropped_from_the_manifest_is_caught(tmp_path: Path) -> None:
    save_steps(str(tmp_path), [1])
    storage = LocalStorage(tmp_path)
    manifest = read_manifest(storage, 1)
    gap = tuple(f for f in manifest.files if not f.path.endswith("tensors-00001.bin"))
    forged = Manifest(**{**manifest.__dict__, "files": gap})
    storage.publish(manifest_path(1), forged.to_json())
    with create_checkpoint_manager(str(tmp_path), options()) as mgr:
        with pytest.raises(CheckpointCorruptError, match=r"lacks tensor segment tensors-00001\.bin"):
            mgr.load(1)


class FailingSegmentStorage(LocalStorage):
    """Local storage whose writes of one file fail after a few chunks (a full disk); it counts open writes,
    so a test can tell whether every writer had ended by the time the failed attempt was deleted."""

    def __init__(self, root: Path, fail_name: str) -> None:
        super().__init__(root)
        self.fail_name = fail_name
        self.armed = False
        self.open_writes = 0
        self.opened: list[str] = []
        self.writing_at_delete: list[int] = []
        self._lock = threading.Lock()

    def delete_tree(self, rel: str) -> None:
        self.writing_at_delete.append(self.open_writes)
        super().delete_tree(rel)

    @contextlib.contextmanager
    def open_write(self, rel: str) -> Iterator[BinaryWriter]:
        with self._lock:
            self.open_writes += 1
            self.opened.append(rel.rsplit("/", 1)[-1])
        try:
            with super().open_write(rel) as out:
                if self.armed and rel.endswith(self.fail_name):
                    yield _FailAfter(out, 3, self)
                else:
                    yield _Slow(out)
        finally:
            with self._lock:
                self.open_writes -= 1


class _FailAfter:
    """Fails after ``writes`` writes, once another file is being written too (so there is a writer to stop)."""

    def __init__(self, out: BinaryWriter, writes: int, storage: FailingSegmentStorage) -> None:
        self.out, self.left, self.storage = out, writes, storage

    def write(self, data: Any, /) -> int | None:
        if self.left == 0:
            deadline = time.monotonic() + 10
            while self.storage.open_writes < 2 and time.monotonic() < deadline:
                time.sleep(0.001)
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        self.left -= 1
        return self.out.write(data)


class _Slow:
    """Keeps the other segments' writers busy while the failing one fails."""

    def __init__(self, out: BinaryWriter) -> None:
        self.out = out

    def write(self, data: Any, /) -> int | None:
        time.sleep(0.002)
        return self.out.write(data)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "background"])
def test_a_failing_segment_write_fails_the_save_and_leaves_the_previous_snapshot_and_no_threads(
    blocking: bool, tmp_path: Path
) -> None:
    before = set(threading.enumerate())
    storage = FailingSegmentStorage(tmp_path, "tensors-00000.bin")
    mgr = create_checkpoint_manager(str(tmp_path), options(), storage=storage)
    try:
        mgr.save(1, make_state(1, **SHAPE), blocking=True)
        storage.armed = True
        with pytest.raises(CheckpointWriteError, match="No space left on device") as info:
            mgr.save(2, make_state(2, **SHAPE), blocking=blocking)
            mgr.wait()
        # the attempt directory was deleted, and the error raised, only once no writer was left running
        assert storage.writing_at_delete[:1] == [0] and storage.open_writes == 0
        assert "tensors-00000.bin" in storage.opened and "tensors-00001.bin" in storage.opened
        assert "step 2" in str(info.value)
        assert storage.list_children(step_dir(2)) == []  # no attempt directory (nor manifest) of step 2
        storage.armed = False
        snap = mgr.load_latest()
        assert snap is not None and snap.step == 1
        assert_same(snap.state, make_state(1, **SHAPE))
    finally:
        mgr.close()
    deadline = time.monotonic() + 5  # a joined thread may linger in enumerate() for an instant
    while set(threading.enumerate()) - before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [t.name for t in set(threading.enumerate()) - before] == []


def _write_single_file_snapshot(root: Path, step: int, state: dict[str, Any]) -> None:
    """A snapshot as written before segments existed: skeleton.pt + one tensors.bin, built by hand."""
    flat = Stager().flatten(state, copy=False)
    data = bytearray()
    for t in flat.tensors:
        data += bytes(-len(data) % 64)
        data += t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    storage = LocalStorage(root)
    token = "00c0ffee00c0ffee"
    storage.make_dirs(f"{step_dir(step)}/{token}")
    entries = []
    for name, payload in (("skeleton.pt", encode_skeleton(flat.skeleton, flat.tensors)), ("tensors.bin", bytes(data))):
        with storage.open_write(f"{step_dir(step)}/{token}/{name}") as out:
            out.write(payload)
        entries.append(FileEntry(f"{token}/{name}", len(payload), hashlib.sha256(payload).hexdigest()))
    manifest = Manifest(step, token, SnapshotKind.PACK, tuple(entries), time.time(), 1, 0, {"torch": "2.6.0"})
    storage.publish(manifest_path(step), manifest.to_json())


def test_a_snapshot_in_the_old_single_tensors_bin_layout_still_loads_and_is_verified(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _write_single_file_snapshot(tmp_path, 1, make_state(1, **SHAPE))
    _write_single_file_snapshot(tmp_path, 2, make_state(2, **SHAPE))
    with create_checkpoint_manager(str(tmp_path), options()) as mgr:
        old = mgr.load(2)
    assert_same(old.state, make_state(2, **SHAPE))
    assert [f.path.split("/")[1] for f in old.manifest.files] == ["skeleton.pt", "tensors.bin"]
    flip_byte(next((tmp_path / step_dir(2)).glob("*/tensors.bin")))
    with caplog.at_level(logging.WARNING), create_checkpoint_manager(str(tmp_path), options()) as mgr:
        snap = mgr.load_latest()
        assert snap is not None and snap.step == 1
        mgr.save(3, make_state(3, **SHAPE), blocking=True)  # a new save beside old snapshots: segments
        assert_same(mgr.load(3).state, make_state(3, **SHAPE))
    assert "sha256 mismatch in" in unusable_warnings(caplog)[0] and "tensors.bin" in unusable_warnings(caplog)[0]


def test_device_cpu_is_the_default_and_sharded_layout_refuses_a_device(tmp_path: Path) -> None:
    save_steps(str(tmp_path / "pack"), [1])
    with create_checkpoint_manager(str(tmp_path / "pack"), options()) as mgr:
        snap = mgr.load_latest(device="cpu")
    assert snap is not None and snap.state["model"]["weight"].device.type == "cpu"
    assert_same(snap.state, make_state(1, **SHAPE))
    with create_checkpoint_manager(str(tmp_path / "dcp"), CheckpointOptions(layout="sharded")) as mgr:  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="replicated layout"):
            mgr.load_latest({"w": torch.zeros(2)}, device="cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_loading_into_cuda_without_cuda_is_a_clear_error(tmp_path: Path) -> None:
    save_steps(str(tmp_path), [1])
    with create_checkpoint_manager(str(tmp_path), options()) as mgr:
        with pytest.raises(ValueError, match="CUDA is not available"):
            mgr.load_latest(device="cuda")
        with pytest.raises(ValueError, match="CUDA is not available"):
            mgr.load(1, device="cuda:0")


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


@cuda_only
@pytest.mark.timeout(120)
def test_load_into_a_cuda_device_through_pinned_buffers_is_bit_identical(target: Target) -> None:
    state = make_state(4, **SHAPE)
    opts = options(storage_options=target.storage_options)
    with create_checkpoint_manager(target.url, opts) as mgr:
        mgr.save(4, state, blocking=True)
        snap = mgr.load_latest(device="cuda")
    assert snap is not None
    tensors = [snap.state["model"]["weight"], snap.state["model"]["bias"], snap.state["counts"]]
    assert all(t.device.type == "cuda" for t in tensors)
    assert_same(_to_cpu(snap.state), state)


@cuda_only
def test_a_corrupt_segment_is_caught_on_the_cuda_path_too(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    save_steps(str(tmp_path), [1, 2])
    flip_byte(segment_files(tmp_path, 2)[2])
    with caplog.at_level(logging.WARNING), create_checkpoint_manager(str(tmp_path), options()) as mgr:
        snap = mgr.load_latest(device=torch.device("cuda"))
    assert snap is not None and snap.step == 1
    assert snap.state["model"]["weight"].is_cuda
    assert_same(_to_cpu(snap.state), make_state(1, **SHAPE))
    assert "blake3 mismatch in" in unusable_warnings(caplog)[0]


@cuda_only
@pytest.mark.timeout(120)
def test_adamw_state_loaded_into_cuda_keeps_its_step_counters_on_cpu_and_trains_on(tmp_path: Path) -> None:
    model = torch.nn.Linear(64, 64).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, 64, device="cuda")).sum().backward()
    optimizer.step()
    with create_checkpoint_manager(str(tmp_path), options()) as mgr:
        mgr.save(1, {"model": model.state_dict(), "optimizer": optimizer.state_dict()}, blocking=True)
        snap = mgr.load_latest(device="cuda")
    assert snap is not None
    steps = [s["step"] for s in snap.state["optimizer"]["state"].values()]
    assert steps and all(s.device.type == "cpu" and s.dim() == 0 for s in steps)
    assert all(s["exp_avg"].is_cuda for s in snap.state["optimizer"]["state"].values())
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fresh.load_state_dict(snap.state["optimizer"])
    model(torch.randn(8, 64, device="cuda")).sum().backward()
    fresh.step()  # a CUDA step counter would make non-capturable AdamW read it back (or refuse) every step
    assert all(s["step"].device.type == "cpu" for s in fresh.state.values())
