"""One save of replicated state: data, then the manifest (commit), then verification and retention.

Runs in the caller (blocking save) or in the manager's writer thread (background save); either way it
only reads the :class:`~elastic.checkpoint.staging.FlatState` it was given, which the caller must not touch
until the job is done.

The data files are written in parallel on an :class:`~elastic.checkpoint.parallel_io.IoPool`: the skeleton,
and the tensor stream cut into segment files (see :mod:`elastic.checkpoint.segments`).  Each segment is
written in chunks straight from the staged tensors' memory through ``storage.open_write`` (fsync'd on
POSIX; its own multipart upload on S3) while a sibling task hashes the same memory (BLAKE3 by default, see
:mod:`elastic.checkpoint.digest`), so writing and hashing overlap even for a state of one segment, without
reading anything back.  What is checked after the commit is ``options.verify_after_write`` (see
:mod:`elastic.checkpoint.verification`).  The first failure stops the
other tasks, all of them end, and only then is the attempt directory deleted and the error raised.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch

from elastic.checkpoint.api import CheckpointCorruptError, CheckpointFencedError, CheckpointOptions, EventHook
from elastic.checkpoint.codec import SKELETON_NAME, encode_skeleton, segment_chunks, tensor_layout
from elastic.checkpoint.digest import DigestAlgorithm, new_hasher
from elastic.checkpoint.layout import (
    MANIFEST_NAME,
    FileEntry,
    Manifest,
    SnapshotKind,
    garbage_step_dirs,
    manifest_path,
    plan_retention,
    step_dir,
)
from elastic.checkpoint.parallel_io import IoPool, check_stop, io_thread_count
from elastic.checkpoint.reader import scan, verify_written
from elastic.checkpoint.segments import plan_segments
from elastic.checkpoint.staging import FlatState
from elastic.checkpoint.storage import CheckpointStorage
from elastic.checkpoint.verification import VerifyMode

__all__ = ["PackSaveJob", "SaveTimings", "apply_retention", "new_token"]

logger = logging.getLogger(__name__)


def new_token() -> str:
    return uuid.uuid4().hex[:16]


@dataclass
class SaveTimings:
    """Seconds spent in each phase of the last save (for logs and the benchmark)."""

    data_s: float = 0.0
    commit_s: float = 0.0
    verify_s: float = 0.0
    cleanup_s: float = 0.0
    bytes_written: int = 0
    verify_mode: str = ""  # the verification applied after the commit ("size", "read_back", ...; "" before)


def _digest(algorithm: DigestAlgorithm, source: Callable[[], Iterable[memoryview]], stop: threading.Event) -> str:
    hasher = new_hasher(algorithm)
    for chunk in source():
        check_stop(stop)
        hasher.update(chunk)
    return hasher.hexdigest()


@dataclass
class PackSaveJob:
    """One save of a flattened replicated state.  ``pool``: the manager's I/O threads; ``None`` makes a
    pool of ``options.io_threads`` for this save alone (closed when it ends)."""

    storage: CheckpointStorage
    step: int
    flat: FlatState
    options: CheckpointOptions
    world_size: int
    writer_rank: int
    events: EventHook | None = None
    meta: Mapping[str, str] = field(default_factory=dict)
    timings: SaveTimings = field(default_factory=SaveTimings)
    pool: IoPool | None = None

    def _event(self, name: str) -> None:
        if self.events is not None:
            self.events(name)

    def _write(self, rel: str, source: Callable[[], Iterable[memoryview]], stop: threading.Event) -> int:
        """Write the chunks of ``source()`` as file ``rel`` (under the step directory); its size once durable."""
        size = 0
        with self.storage.open_write(f"{step_dir(self.step)}/{rel}") as out:
            for chunk in source():
                check_stop(stop)
                out.write(chunk)
                size += len(chunk)
                self._event("data_chunk")
        self._event("data_file_closed")
        return size

    def _write_data(self, pool: IoPool, token: str) -> tuple[FileEntry, ...]:
        """Write the skeleton and every segment in parallel; their manifest entries, skeleton first."""
        tensors = self.flat.tensors
        table, total = tensor_layout(tensors)
        skeleton = memoryview(encode_skeleton(self.flat.skeleton, self.flat.tensors))
        chunk = self.options.chunk_bytes
        # (file name, its size, a fresh iterator over its bytes), in manifest order
        files: list[tuple[str, int, Callable[[], Iterable[memoryview]]]] = [
            (SKELETON_NAME, len(skeleton), functools.partial(iter, (skeleton,)))
        ]
        for seg in plan_segments(total, self.options.segment_bytes):
            files.append((seg.name, seg.size, functools.partial(segment_chunks, tensors, table, seg, chunk)))
        algorithm = self.options.file_digest
        tasks: list[Callable[[threading.Event], int | str]] = []
        for name, _size, source in files:  # a file's writer and hasher side by side: they run together
            tasks.append(functools.partial(self._write, f"{token}/{name}", source))
            tasks.append(functools.partial(_digest, algorithm, source))
        results = pool.run_all(tasks)
        entries = []
        for index, (name, size, _source) in enumerate(files):
            written, digest = results[2 * index], results[2 * index + 1]
            if written != size or not isinstance(digest, str):
                raise AssertionError(f"{name}: wrote {written!r} bytes of {size}, digest {digest!r}")
            entries.append(FileEntry(f"{token}/{name}", size, digest, algorithm))
        return tuple(entries)

    def run(self) -> Manifest:
        with contextlib.ExitStack() as stack:
            pool = self.pool
            if pool is None:
                pool = stack.enter_context(IoPool(io_thread_count(self.options.io_threads)))
            return self._run(pool)

    def _run(self, pool: IoPool) -> Manifest:
        token = new_token()
        sdir = step_dir(self.step)
        self._event("staging_begin")
        self.flat.finish_staging()  # deferred copies (overlap_with) first: the training loop waits on it
        self._event("save_begin")
        started = time.perf_counter()
        self.storage.make_dirs(f"{sdir}/{token}")
        try:
            self._event("data_begin")
            entries = self._write_data(pool, token)
            self._event("data_done")
            manifest = Manifest(
                step=self.step,
                token=token,
                kind=SnapshotKind.PACK,
                files=entries,
                created_unix=time.time(),
                world_size=self.world_size,
                writer_rank=self.writer_rank,
                meta={"torch": torch.__version__, **self.meta, **generation_meta(self.options)},
            )
            self.timings.data_s = time.perf_counter() - started
            self.timings.bytes_written = manifest.total_bytes
            self._event("manifest_begin")
            mark = time.perf_counter()
            check_fence(self.storage, self.options, self.step)
            self.storage.publish(manifest_path(self.step), manifest.to_json(self.options.signing_key))
        except BaseException:
            with contextlib.suppress(Exception):
                self.storage.delete_tree(f"{sdir}/{token}")
            raise
        self.timings.commit_s = time.perf_counter() - mark
        self._event("manifest_committed")
        finish_commit(self.storage, manifest, self.options, self.timings, self._event, pool=pool)
        return manifest


GENERATION_META = "generation"


def generation_meta(options: CheckpointOptions) -> dict[str, str]:
    """What a manifest records of the saving generation (nothing without one)."""
    return {} if options.generation is None else {GENERATION_META: str(options.generation)}


def check_fence(storage: CheckpointStorage, options: CheckpointOptions, step: int) -> None:
    """Refuse (:class:`CheckpointFencedError`) a commit by generation *g* when a snapshot of a newer generation
    is committed under the root: a zombie of an old generation (cut off from the service, still saving on its
    way out) must not replace or delete what the job's current generation wrote."""
    if options.generation is None:
        return
    for entry in scan(storage, options.signing_key):
        theirs = entry.manifest.meta.get(GENERATION_META) if entry.manifest is not None else None
        if theirs is not None and theirs.isascii() and theirs.isdigit() and int(theirs) > options.generation:
            raise CheckpointFencedError(
                f"save of step {step} by job generation {options.generation} refused: generation {theirs} "
                f"committed step {entry.step} under {storage.url}"
            )


def finish_commit(
    storage: CheckpointStorage,
    manifest: Manifest,
    options: CheckpointOptions,
    timings: SaveTimings,
    event: EventHook,
    *,
    pool: IoPool | None = None,
) -> None:
    """After a commit: verify the new snapshot as ``options.verify_after_write`` says (read-backs on ``pool``,
    else on a pool of ``options.io_threads``), then apply retention."""
    mark = time.perf_counter()
    mode = storage.resolve_verify_mode(options.verify_mode)
    try:
        applied = verify_written(storage, manifest, mode, options.chunk_bytes, pool=pool, io_threads=options.io_threads)
    except CheckpointCorruptError as exc:
        raise CheckpointCorruptError(
            f"snapshot step {manifest.step} failed verification ({mode.value}) right after writing ({exc}); "
            "older snapshots were kept"
        ) from exc
    timings.verify_s = time.perf_counter() - mark
    timings.verify_mode = applied.value
    if applied is not VerifyMode.NONE:
        event("verified")
    mark = time.perf_counter()
    event("cleanup_begin")
    apply_retention(storage, manifest, options, event)
    timings.cleanup_s = time.perf_counter() - mark
    event("cleanup_done")


def apply_retention(
    storage: CheckpointStorage, manifest: Manifest, options: CheckpointOptions, event: EventHook
) -> list[int]:
    """Delete snapshots beyond retention and dead attempts older than ``manifest``; return deleted steps.

    A snapshot is deleted manifest first, so a crash half-way leaves an uncommitted directory (garbage
    for a later cleanup), never a committed snapshot with missing files.
    """
    step = manifest.step
    sdir = step_dir(step)
    # Earlier attempts at this step and stale manifest temp files go now, unless generations share the root
    # (the service's jobs): then another generation may be writing this very step, and its attempt is only
    # removed with the whole step directory, by a later retention.
    for name in storage.list_children(sdir) if options.generation is None else ():
        if name not in (MANIFEST_NAME, manifest.token):
            if "." in name:
                storage.delete_file(f"{sdir}/{name}")
            else:
                storage.delete_tree(f"{sdir}/{name}")
    entries = scan(storage, options.signing_key)  # with a key, only this job's signed snapshots count
    committed = [e.step for e in entries if e.manifest is not None]
    doomed = plan_retention(committed, step, options.keep_last, options.keep_every)
    for old in doomed:
        storage.delete_file(manifest_path(old))
        event("snapshot_uncommitted")
        storage.delete_tree(step_dir(old))
    for old in garbage_step_dirs([e.step for e in entries if not e.foreign], committed, step):
        storage.delete_tree(step_dir(old))
    if doomed:
        logger.info("checkpoint retention removed step(s) %s under %s", ", ".join(map(str, doomed)), storage.url)
    return doomed
