"""One save of replicated state: data, then the manifest (commit), then verification and retention.

Runs in the caller (blocking save) or in the manager's writer thread (background save); either way it
only reads the :class:`~elastic.checkpoint.staging.FlatState` it was given, which the caller must not touch
until the job is done.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import queue
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from elastic.checkpoint.api import CheckpointCorruptError, CheckpointFencedError, CheckpointOptions, EventHook
from elastic.checkpoint.codec import SKELETON_NAME, TENSORS_NAME, encode_skeleton, write_tensors
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
from elastic.checkpoint.reader import scan, verify_files
from elastic.checkpoint.staging import FlatState
from elastic.checkpoint.storage import CheckpointStorage

__all__ = ["PackSaveJob", "SaveTimings", "apply_retention", "new_token"]

logger = logging.getLogger(__name__)


class _PipelinedHasher:
    """sha256 of a stream of chunks, computed in a helper thread while the caller writes the same chunks.

    ``hashlib`` and ``os.write`` both release the GIL on large buffers, so hashing overlaps with writing
    instead of adding to it.  Chunks are views (no copies); they must stay unchanged until ``hexdigest``.
    """

    def __init__(self) -> None:
        self._hasher = hashlib.sha256()
        self._queue: queue.SimpleQueue[memoryview | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="checkpoint-sha256", daemon=True)
        self._thread.start()
        self._digest: str | None = None

    def _run(self) -> None:
        while (chunk := self._queue.get()) is not None:
            self._hasher.update(chunk)

    def update(self, chunk: memoryview) -> None:
        self._queue.put(chunk)

    def _finish(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def hexdigest(self) -> str:
        if self._digest is None:
            self._finish()
            self._digest = self._hasher.hexdigest()
        return self._digest

    def __enter__(self) -> _PipelinedHasher:
        return self

    def __exit__(self, *exc: object) -> None:
        self._finish()


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


@dataclass
class PackSaveJob:
    storage: CheckpointStorage
    step: int
    flat: FlatState
    options: CheckpointOptions
    world_size: int
    writer_rank: int
    events: EventHook | None = None
    meta: Mapping[str, str] = field(default_factory=dict)
    timings: SaveTimings = field(default_factory=SaveTimings)

    def _event(self, name: str) -> None:
        if self.events is not None:
            self.events(name)

    def _write_file(self, rel: str, payload: bytes | FlatState) -> FileEntry:
        with _PipelinedHasher() as hasher, self.storage.open_write(f"{step_dir(self.step)}/{rel}") as out:
            if isinstance(payload, bytes):
                hasher.update(memoryview(payload))
                out.write(payload)
                size = len(payload)
            else:
                size = write_tensors(
                    payload, out, hasher.update, self.options.chunk_bytes, lambda: self._event("data_chunk")
                )
        self._event("data_file_closed")
        return FileEntry(path=rel, size=size, sha256=hasher.hexdigest())

    def run(self) -> Manifest:
        token = new_token()
        sdir = step_dir(self.step)
        self._event("staging_begin")
        self.flat.finish_staging()  # deferred copies (overlap_with) first: the training loop waits on it
        self._event("save_begin")
        started = time.perf_counter()
        self.storage.make_dirs(f"{sdir}/{token}")
        try:
            self._event("data_begin")
            entries = (
                self._write_file(f"{token}/{SKELETON_NAME}", encode_skeleton(self.flat)),
                self._write_file(f"{token}/{TENSORS_NAME}", self.flat),
            )
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
        finish_commit(self.storage, manifest, self.options, self.timings, self._event)
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
        if theirs is not None and theirs.isdigit() and int(theirs) > options.generation:
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
) -> None:
    """After a commit: verify the new snapshot (if configured), then apply retention."""
    if options.verify_after_write:
        mark = time.perf_counter()
        try:
            verify_files(storage, manifest, options.chunk_bytes)
        except CheckpointCorruptError as exc:
            raise CheckpointCorruptError(
                f"snapshot step {manifest.step} failed verification right after writing ({exc}); "
                "older snapshots were kept"
            ) from exc
        timings.verify_s = time.perf_counter() - mark
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
        logger.info(
            "checkpoint retention removed step(s) %s under %s", ", ".join(map(str, doomed)), storage.url
        )
    return doomed
