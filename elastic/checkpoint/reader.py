"""Finding committed snapshots and verifying and reading them back.

A step directory counts only if its ``manifest.json`` parses and checks out; one without a manifest is a
save that never committed and is silently ignored.  Verification compares sizes from one listing first
(cheap, catches truncation and missing files), then each file's digest (BLAKE3, or SHA-256 for snapshots
written before it) while reading (catches changed bytes).  Files
are read in parallel on an :class:`~elastic.checkpoint.parallel_io.IoPool`, each by one task in chunks that
are hashed as they arrive; a pack snapshot's tensor files land in one allocation per tensor, in host memory
or, through small pinned host buffers, straight in a CUDA device's memory (:mod:`elastic.checkpoint.file_reads`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from elastic.checkpoint.api import CheckpointCorruptError, CheckpointLoadError
from elastic.checkpoint.codec import SKELETON_NAME, PackDecodeError, allocate_tensors, read_skeleton, rebuild_state
from elastic.checkpoint.file_reads import DeviceSink, HostSink, HostTensorSink, ScratchSink, Sink, read_file
from elastic.checkpoint.layout import (
    FileEntry,
    Manifest,
    ManifestError,
    ManifestSignatureError,
    SnapshotKind,
    listing_problems,
    manifest_path,
    parse_step_dir,
    step_dir,
)
from elastic.checkpoint.parallel_io import IoPool, io_thread_count
from elastic.checkpoint.segments import Segment, segment_extents, tensor_file_order
from elastic.checkpoint.storage import CheckpointStorage
from elastic.checkpoint.verification import VerifyMode

__all__ = ["ScanEntry", "read_manifest", "read_pack", "scan", "verify_files", "verify_written"]

logger = logging.getLogger(__name__)
_T = TypeVar("_T")


@dataclass(frozen=True)
class ScanEntry:
    """One step directory: its manifest, or why it has none that counts (``None`` = never committed)."""

    step: int
    manifest: Manifest | None
    problem: str | None
    foreign: bool = False  # a valid manifest signed by another key (or none): not this job's to delete


def read_manifest(storage: CheckpointStorage, step: int, key: bytes | None = None) -> Manifest:
    """The manifest of ``step``; ``FileNotFoundError`` if uncommitted, ``ManifestError`` if invalid (with
    ``key``: also if not signed with it)."""
    return Manifest.from_json(storage.read_bytes(manifest_path(step)), expected_step=step, key=key)


def scan(storage: CheckpointStorage, key: bytes | None = None) -> list[ScanEntry]:
    """Every step directory under the root, oldest first (``key``: see :func:`read_manifest`)."""
    entries = []
    for name in storage.list_children(""):
        step = parse_step_dir(name)
        if step is None:
            continue
        try:
            entries.append(ScanEntry(step, read_manifest(storage, step, key), None))
        except FileNotFoundError:
            entries.append(ScanEntry(step, None, None))
        except ManifestSignatureError as exc:
            entries.append(ScanEntry(step, None, f"invalid manifest: {exc}", foreign=True))
        except ManifestError as exc:
            entries.append(ScanEntry(step, None, f"invalid manifest: {exc}"))
    return sorted(entries, key=lambda e: e.step)


def _check_sizes(storage: CheckpointStorage, manifest: Manifest) -> None:
    problems = listing_problems(manifest, storage.list_sizes(step_dir(manifest.step)))
    if problems:
        raise CheckpointCorruptError("; ".join(problems))


@contextlib.contextmanager
def _missing_is_corrupt() -> Iterator[None]:
    try:
        yield
    except FileNotFoundError as exc:
        raise CheckpointCorruptError(f"a file is missing: {exc}") from exc


@contextlib.contextmanager
def _pool_for(pool: IoPool | None, io_threads: int | None) -> Iterator[IoPool]:
    """``pool``, or a pool of ``io_threads`` (``None``: sized to the machine) closed on exit."""
    if pool is not None:
        yield pool
        return
    with IoPool(io_thread_count(io_threads)) as own:
        yield own


def verify_files(
    storage: CheckpointStorage,
    manifest: Manifest,
    chunk_bytes: int = 8 << 20,
    *,
    pool: IoPool | None = None,
    io_threads: int | None = None,
    uncached: bool = False,
) -> None:
    """Raise :class:`CheckpointCorruptError` unless every file has its manifest size and digest.

    Sizes come from one listing; then every file is re-hashed, in parallel on ``pool`` (``None``: a pool of
    ``io_threads`` for this call); the first mismatch stops the rest.  ``uncached``: the files are read from
    the medium, not from this host's page cache.
    """
    with _missing_is_corrupt():
        _check_sizes(storage, manifest)
        sdir = step_dir(manifest.step)
        tasks = [
            lambda stop, e=entry: read_file(
                storage, f"{sdir}/{e.path}", e, ScratchSink(e.size, chunk_bytes), chunk_bytes, stop, uncached=uncached
            )
            for entry in manifest.files
        ]
        with _pool_for(pool, io_threads) as run_on:
            run_on.run_all(tasks)


def verify_written(
    storage: CheckpointStorage,
    manifest: Manifest,
    mode: VerifyMode,
    chunk_bytes: int = 8 << 20,
    *,
    pool: IoPool | None = None,
    io_threads: int | None = None,
) -> VerifyMode:
    """Check a snapshot just written as ``mode`` says (``auto``: as the storage says, see
    :mod:`elastic.checkpoint.verification`); the mode applied.  Raises :class:`CheckpointCorruptError`."""
    resolved = storage.resolve_verify_mode(mode)
    if resolved is VerifyMode.SIZE:
        with _missing_is_corrupt():
            _check_sizes(storage, manifest)
    elif resolved.reads_data:
        uncached = resolved is VerifyMode.READ_BACK_UNCACHED
        verify_files(storage, manifest, chunk_bytes, pool=pool, io_threads=io_threads, uncached=uncached)
    return resolved


def _resolve_device(device: torch.device | str | None) -> torch.device:
    resolved = torch.device("cpu" if device is None else device)
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"cannot load a snapshot into {resolved}: CUDA is not available")
        if resolved.index is None:
            resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


def read_pack(
    storage: CheckpointStorage,
    manifest: Manifest,
    *,
    weights_only: bool,
    chunk_bytes: int = 8 << 20,
    pool: IoPool | None = None,
    io_threads: int | None = None,
    device: torch.device | str | None = None,
) -> Any:
    """Verify and decode a replicated (pack) snapshot, reading each file once, all files in parallel.

    The skeleton is read first; its table says where each tensor's bytes go.  Then the tensor files (segments
    in order, or the single ``tensors.bin`` of older snapshots) are read in parallel into one allocation per
    tensor (:func:`~elastic.checkpoint.codec.allocate_tensors`): host memory for ``device`` ``None``/CPU; for a
    CUDA ``device`` each task reads its chunks into two pinned host buffers in turn and copies their pieces
    asynchronously into the tensors on the device, so they come back there without a full host copy; any other
    device gets each host tensor copied over.  0-dimensional tensors come back on the CPU, and so do tensors
    kept inside the skeleton (sparse, quantized).
    Raises :class:`CheckpointCorruptError` (missing or changed files, manifest without tensor data) or
    :class:`CheckpointLoadError` (verified bytes that do not decode).
    """
    if manifest.kind != SnapshotKind.PACK:
        raise CheckpointLoadError(f"snapshot step {manifest.step} is of kind {manifest.kind.value}, not pack")
    by_name = {entry.path.rsplit("/", 1)[-1]: entry for entry in manifest.files}
    if SKELETON_NAME not in by_name:
        raise CheckpointCorruptError(f"manifest lacks {SKELETON_NAME}")
    try:
        data_files = [by_name[name] for name in tensor_file_order(by_name)]
    except ValueError as exc:
        raise CheckpointCorruptError(str(exc)) from exc
    target = _resolve_device(device)
    total = sum(entry.size for entry in data_files)
    sdir = step_dir(manifest.step)
    skeleton_entry = by_name[SKELETON_NAME]
    skeleton_bytes = bytearray(skeleton_entry.size)

    def read_into(entry: FileEntry, make_sink: Callable[[], Sink]) -> Callable[[threading.Event], None]:
        # the sink is made when the task starts: pinned buffers exist only for the files being read
        return lambda stop: read_file(storage, f"{sdir}/{entry.path}", entry, make_sink(), chunk_bytes, stop)

    with _missing_is_corrupt(), _pool_for(pool, io_threads) as run_on:
        _check_sizes(storage, manifest)
        # the skeleton first (a small file): its table says where each tensor's bytes go
        run_on.run_all([read_into(skeleton_entry, lambda: HostSink(memoryview(skeleton_bytes)))])
        skeleton = _decode(manifest.step, lambda: read_skeleton(bytes(skeleton_bytes), weights_only=weights_only))
        if skeleton.total != total:
            raise CheckpointLoadError(
                f"snapshot step {manifest.step} is intact but does not decode: tensor data "
                f"has {total} bytes, skeleton says {skeleton.total}"
            )
        home = target if target.type == "cuda" else torch.device("cpu")
        tensors = allocate_tensors(skeleton, home)
        if home.type == "cuda":
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(home))  # the allocations' stream: the copies wait for it
        offset = 0
        tasks: list[Callable[[threading.Event], None]] = []
        for entry in data_files:
            segment = Segment(len(tasks), offset, offset + entry.size)
            extents = _decode(manifest.step, functools.partial(segment_extents, skeleton.table, segment))
            if home.type == "cuda":
                make: Callable[[], Sink] = functools.partial(
                    DeviceSink, tensors, extents, home, entry.size, chunk_bytes, ready
                )
            else:
                make = functools.partial(HostTensorSink, tensors, extents, chunk_bytes)
            tasks.append(read_into(entry, make))
            offset += entry.size
        run_on.run_all(tasks)
    if target.type not in ("cpu", "cuda"):
        pairs = zip(tensors, skeleton.tensors, strict=True)
        tensors = [t if t is None or packed.on_host else t.to(target) for t, packed in pairs]
    return _decode(manifest.step, functools.partial(rebuild_state, skeleton, tensors, target))


def _decode(step: int, decode: Callable[[], _T]) -> _T:
    """``decode()``, its format errors (and a table that does not fit the files) as :class:`CheckpointLoadError`."""
    try:
        return decode()
    except (PackDecodeError, ValueError) as exc:
        raise CheckpointLoadError(f"snapshot step {step} is intact but does not decode: {exc}") from exc
