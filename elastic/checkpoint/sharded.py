"""Sharded state (FSDP, DTensor) through ``torch.distributed.checkpoint``, committed by our manifest.

DCP does the sharded work (planning, de-duplication, resharding on load, its async save); this module
adds what it lacks for shared storage: a per-attempt directory, a digest of every file, and the manifest as
the commit point.  DCP's storage writer is subclassed so that

- ``write_data`` (every rank) records the size and digest of each file that rank wrote, hashed as DCP wrote it
  (:mod:`elastic.checkpoint.write_digests`; a file it could not hash so is read back), and publishes
  ``part-<rank>.json`` next to them before DCP gathers the write results;
- ``finish`` (coordinator, after all ranks' data is written) lets DCP write ``.metadata``, merges the part
  files and commits ``manifest.json``; then verification and retention run as for replicated state.

Saves and loads are collectives: every rank of the job calls them.  They use a dedicated gloo group so a
background save never interleaves with the training loop's collectives.  :class:`ShardedCheckpointManager` is
the manager of this layout (what it shares with the replicated one: :mod:`elastic.checkpoint.base`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from elastic.checkpoint.api import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointLoadError,
    CheckpointOptions,
    CheckpointWriteError,
    EventHook,
    Snapshot,
    StateLayout,
)
from elastic.checkpoint.base import StorageCheckpointManager
from elastic.checkpoint.digest import DigestAlgorithm, new_hasher
from elastic.checkpoint.layout import FileEntry, Manifest, ManifestError, SnapshotKind, manifest_path, step_dir
from elastic.checkpoint.reader import verify_files
from elastic.checkpoint.storage import CheckpointStorage, FsspecStorage, LocalStorage
from elastic.checkpoint.write_digests import WriteDigests, hash_while_writing
from elastic.checkpoint.writer import SaveTimings, check_fence, finish_commit, generation_meta, new_token
from elastic.compat import dcp_no_dist, fsspec_checkpoint_io, fsspec_dcp_io
from elastic.gloo_group import GlooGroupBeside

__all__ = ["ShardedCheckpointManager"]

FsspecReader, FsspecWriter = fsspec_checkpoint_io()

logger = logging.getLogger(__name__)

_METADATA = ".metadata"


def _hash_file(storage: CheckpointStorage, rel: str, chunk_bytes: int, algorithm: DigestAlgorithm) -> tuple[int, str]:
    hasher = new_hasher(algorithm)
    size = 0
    with storage.open_read(rel) as f:
        while block := f.read(chunk_bytes):
            hasher.update(block)
            size += len(block)
    return size, hasher.hexdigest()


class _Commit:
    """What the DCP writer needs to know to commit one attempt (shared by all of its hooks)."""

    def __init__(
        self,
        storage: CheckpointStorage,
        options: CheckpointOptions,
        step: int,
        token: str,
        rank: int,
        world: int,
        events: EventHook,
    ) -> None:
        self.storage, self.options, self.step, self.token, self.rank, self.world, self.events = (
            storage,
            options,
            step,
            token,
            rank,
            world,
            events,
        )
        self.rel = f"{step_dir(step)}/{token}"
        self.digests = WriteDigests(options.file_digest)  # filled by the DCP writer as it writes
        self.timings = SaveTimings()
        self.manifest: Manifest | None = None

    def after_write(self, rank: int, results: list[Any]) -> None:
        names = sorted({r.storage_data.relative_path for r in results})
        algorithm = self.options.file_digest
        entries = []
        read_back = 0
        for name in names:
            known = self.digests.get(name)
            if known is not None:
                size, digest = known.size, known.digest
            else:  # not hashed while written (see elastic.checkpoint.write_digests): read it back
                size, digest = _hash_file(self.storage, f"{self.rel}/{name}", self.options.chunk_bytes, algorithm)
                read_back += 1
            entries.append(FileEntry(f"{self.token}/{name}", size, digest, algorithm).to_dict())
        if read_back:
            logger.info(
                "sharded checkpoint step %d: %d of rank %d's %d files read back to be hashed",
                self.step,
                read_back,
                rank,
                len(names),
            )
        self.storage.publish(f"{self.rel}/part-{rank:05d}.json", json.dumps(entries).encode())
        self.events("data_done")

    def commit(self, results: list[list[Any]]) -> None:
        files: dict[str, FileEntry] = {}
        for rank, rank_results in enumerate(results):
            if not rank_results:
                continue
            part = json.loads(self.storage.read_bytes(f"{self.rel}/part-{rank:05d}.json"))
            for item in part:
                try:
                    entry = FileEntry.from_dict(item)
                except ManifestError as exc:
                    raise CheckpointWriteError(f"rank {rank}'s part file is malformed: {exc}") from exc
                files[entry.path] = entry
            for r in rank_results:
                if f"{self.token}/{r.storage_data.relative_path}" not in files:
                    raise CheckpointWriteError(f"rank {rank} wrote {r.storage_data.relative_path} but did not hash it")
        algorithm = self.options.file_digest
        size, digest = _hash_file(self.storage, f"{self.rel}/{_METADATA}", self.options.chunk_bytes, algorithm)
        files[f"{self.token}/{_METADATA}"] = FileEntry(f"{self.token}/{_METADATA}", size, digest, algorithm)
        manifest = Manifest(
            step=self.step,
            token=self.token,
            kind=SnapshotKind.DCP,
            files=tuple(files[k] for k in sorted(files)),
            created_unix=time.time(),
            world_size=self.world,
            writer_rank=0,
            meta={"torch": torch.__version__, **generation_meta(self.options)},
        )
        self.events("manifest_begin")
        check_fence(self.storage, self.options, self.step)
        self.storage.publish(manifest_path(self.step), manifest.to_json(self.options.signing_key))
        self.events("manifest_committed")
        self.manifest = manifest
        finish_commit(self.storage, manifest, self.options, self.timings, self.events)


def _writer_class(base: type) -> type:
    class _ManifestingWriter(base):
        """A DCP storage writer that hashes what it wrote and commits our manifest in ``finish``."""

        commit_state: _Commit

        def write_data(self, plan: Any, planner: Any) -> Any:
            future = super().write_data(plan, planner)
            future.wait()
            # this rank's own number: torch's writers learn theirs only since torch 2.7
            self.commit_state.after_write(self.commit_state.rank, future.value())
            return future

        def finish(self, metadata: Any, results: list[list[Any]]) -> None:
            super().finish(metadata, results)
            self.commit_state.commit(results)

    return _ManifestingWriter


_LocalWriter = _writer_class(FileSystemWriter)
_FsspecWriter = _writer_class(FsspecWriter)


@contextlib.contextmanager
def _single_process_is_intended() -> Iterator[None]:
    """DCP warns on every call without a process group; that case is intended here (world of one)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is .*unavailable or uninitialized")
        yield


def _require_template(template: Mapping[str, Any] | None) -> Mapping[str, Any]:
    if template is None:
        raise CheckpointLoadError("sharded snapshots load in place: pass template= (the current state dict)")
    return template


class ShardedCheckpointManager(StorageCheckpointManager):
    """Saves ``StateLayout.SHARDED`` state with DCP under our commit protocol (see the module docstring).

    Saves and loads are collectives of every rank (over a gloo group beside the default one, made again for
    each default group in live mode).  Loads need ``template`` (the current state dict, loaded in place) and take
    no ``device``; ``overlap_with`` does not apply (DCP stages sharded state itself).  ``last_committed_step`` is
    known on rank 0, where the commit happens.
    """

    layout = StateLayout.SHARDED

    def __init__(self, storage: CheckpointStorage, options: CheckpointOptions, events: EventHook | None = None) -> None:
        super().__init__(storage, options, events)
        self._emit: EventHook = events or (lambda _name: None)
        self._group = GlooGroupBeside("sharded checkpoints")  # made again for each default group (live mode)
        self._future: Any = None
        self._last_committed: int | None = None  # on the coordinator (rank 0), where the commit happens
        self._step: int | None = None

    # -- process group --------------------------------------------------------------------------------
    def _pg(self) -> Any:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        return self._group.get()  # collective: every rank's first save/load in a group

    def _broadcast(self, value: Any) -> Any:
        pg = self._pg()
        if pg is None:
            return value
        box = [value]
        dist.broadcast_object_list(box, group=pg, group_src=0)
        return box[0]

    def _rank_world(self) -> tuple[int, int]:
        pg = self._pg()
        return (dist.get_rank(pg), dist.get_world_size(pg)) if pg is not None else (0, 1)

    # -- saving ---------------------------------------------------------------------------------------
    def _make_writer(self, commit: _Commit) -> Any:
        path = self._storage.full_path(commit.rel)
        if isinstance(self._storage, LocalStorage):
            writer = _LocalWriter(path, sync_files=True)
        elif isinstance(self._storage, FsspecStorage):
            writer = fsspec_dcp_io(
                _FsspecWriter,
                path,
                dict(self._options.storage_options),
                sync_files=not self._storage.is_object_store,
            )
        else:
            raise CheckpointError(
                f"sharded checkpoints need a LocalStorage or FsspecStorage, not {type(self._storage)}"
            )
        writer.commit_state = commit
        hash_while_writing(writer, commit.digests)
        return writer

    def _save(
        self, step: int, state: Mapping[str, Any], *, blocking: bool, overlap_with: torch.optim.Optimizer | None
    ) -> None:
        """Every rank: the previous save is waited for, rank 0 picks the attempt's token and makes its directory,
        then DCP writes (``dcp.save``, or ``dcp.async_save`` whose future commits in the background)."""
        if overlap_with is not None:
            raise ValueError("overlap_with applies to the replicated layout (DCP stages sharded state)")
        self.wait()
        rank, world = self._rank_world()
        token = self._broadcast(new_token() if rank == 0 else None)
        commit = _Commit(self._storage, self._options, step, token, rank, world, self._emit)
        if rank == 0:
            self._storage.make_dirs(commit.rel)
        self._emit("save_begin")
        writer = self._make_writer(commit)
        pg = self._pg()
        try:
            if blocking:
                with _single_process_is_intended():
                    dcp.save(dict(state), storage_writer=writer, process_group=pg, **dcp_no_dist(dcp.save, pg is None))
                self._log_commit(step, commit)
                return
            self._future = dcp.async_save(
                dict(state), storage_writer=writer, process_group=pg, **dcp_no_dist(dcp.async_save, pg is None)
            )
            self._step = step

            def log_when_done(future: Any) -> None:
                if future.exception() is None:
                    self._log_commit(step, commit)

            self._future.add_done_callback(log_when_done)
        except Exception as exc:
            raise CheckpointWriteError(
                f"saving sharded checkpoint step {step} to {self._storage.url} failed: {exc}"
            ) from exc

    def _log_commit(self, step: int, commit: _Commit) -> None:
        if commit.manifest is not None:
            self._last_committed = step
            logger.info(
                "sharded checkpoint step %d committed at %s (%.1f MiB)",
                step,
                self._storage.url,
                commit.manifest.total_bytes / 2**20,
            )

    @property
    def last_committed_step(self) -> int | None:
        return self._last_committed

    @property
    def in_flight(self) -> bool:
        return self._future is not None and not self._future.done()

    def abandon(self) -> None:
        """Stop waiting for the in-flight save (see :meth:`CheckpointManager.abandon`): its error is logged."""
        future, self._future = self._future, None
        if future is None:
            return
        step, url = self._step, self._storage.url

        def log_failure(done: Any) -> None:
            exc = done.exception()
            if exc is not None:
                first = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
                logger.warning(
                    "sharded checkpoint step %d to %s, given up at a re-form, did not commit: %s", step, url, first
                )

        future.add_done_callback(log_failure)

    def wait(self) -> None:
        future, self._future = self._future, None
        if future is None:
            return
        try:
            future.result()
        except Exception as exc:
            raise CheckpointWriteError(
                f"saving sharded checkpoint step {self._step} to {self._storage.url} failed: {exc}"
            ) from exc

    # -- loading --------------------------------------------------------------------------------------
    def _check_device(self, device: torch.device | str | None) -> None:
        if device is not None:
            raise ValueError("device applies to the replicated layout (sharded state loads into its template)")

    def _reader(self, manifest: Manifest) -> Any:
        path = self._storage.full_path(f"{step_dir(manifest.step)}/{manifest.token}")
        if isinstance(self._storage, LocalStorage):
            return FileSystemReader(path)
        return fsspec_dcp_io(FsspecReader, path, dict(self._options.storage_options))

    def _dcp_load(self, manifest: Manifest, template: Mapping[str, Any] | None) -> Snapshot:
        template = _require_template(template)
        if manifest.kind != SnapshotKind.DCP:
            raise CheckpointLoadError(f"snapshot step {manifest.step} is of kind {manifest.kind.value}, not dcp")
        state = dict(template)
        pg = self._pg()
        try:
            with _single_process_is_intended():
                dcp.load(
                    state,
                    storage_reader=self._reader(manifest),
                    process_group=pg,
                    **dcp_no_dist(dcp.load, pg is None),
                )
        except Exception as exc:
            raise CheckpointLoadError(f"loading sharded snapshot step {manifest.step} failed: {exc}") from exc
        return Snapshot(step=manifest.step, state=state, manifest=manifest, url=self._storage.url)

    def _load_manifest(
        self, manifest: Manifest, template: Mapping[str, Any] | None, device: torch.device | str | None
    ) -> Snapshot:
        """Rank 0 verifies ``manifest``'s files, every rank learns the verdict, then all load."""
        _require_template(template)
        problem = None
        if self._rank_world()[0] == 0:
            try:
                verify_files(self._storage, manifest, self._options.chunk_bytes)
            except CheckpointCorruptError as exc:
                problem = str(exc)
        problem = self._broadcast(problem)
        if problem is not None:
            raise CheckpointCorruptError(problem)
        return self._dcp_load(manifest, template)

    def _load_newest(self, template: Mapping[str, Any] | None, device: torch.device | str | None) -> Snapshot | None:
        """Rank 0 picks the newest manifest whose files verify, every rank loads that one."""
        _require_template(template)
        payload = None
        if self._rank_world()[0] == 0:
            manifest = self._newest(self._verified)
            payload = manifest.to_json(self._options.signing_key) if manifest is not None else None
        payload = self._broadcast(payload)
        if payload is None:
            return None
        return self._dcp_load(Manifest.from_json(payload, key=self._options.signing_key), template)

    def _verified(self, manifest: Manifest) -> Manifest:
        """``manifest`` once its files verify (raises :class:`CheckpointCorruptError` otherwise)."""
        verify_files(self._storage, manifest, self._options.chunk_bytes, io_threads=self._options.io_threads)
        return manifest
