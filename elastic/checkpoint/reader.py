"""Finding committed snapshots and verifying and reading them back.

A step directory counts only if its ``manifest.json`` parses and checks out; one without a manifest is a
save that never committed and is silently ignored.  Verification compares sizes from one listing first
(cheap, catches truncation and missing files), then sha256 while reading (catches changed bytes).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from elastic.checkpoint.api import CheckpointCorruptError, CheckpointLoadError
from elastic.checkpoint.codec import SKELETON_NAME, TENSORS_NAME, PackDecodeError, decode_pack
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
from elastic.checkpoint.storage import CheckpointStorage

__all__ = ["ScanEntry", "read_manifest", "read_pack", "scan", "verify_files"]

logger = logging.getLogger(__name__)


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


def _read_into(
    storage: CheckpointStorage, manifest: Manifest, entry: FileEntry, chunk_bytes: int, keep: bool
) -> bytearray:
    """Read one file, hashing it; the bytes are kept only when ``keep``."""
    hasher = hashlib.sha256()
    size = entry.size
    buf = bytearray(size if keep else min(size, chunk_bytes))
    view = memoryview(buf)
    done = 0
    rel = f"{step_dir(manifest.step)}/{entry.path}"
    with storage.open_read(rel) as f:
        while done < size:
            want = min(chunk_bytes, size - done)
            target = view[done : done + want] if keep else view[:want]
            got = f.readinto(target)
            if not got:
                raise CheckpointCorruptError(f"{entry.path} ended after {done} of {size} bytes")
            hasher.update(target[:got])
            done += got
        if f.read(1):
            raise CheckpointCorruptError(f"{entry.path} is longer than {size} bytes")
    if hasher.hexdigest() != entry.sha256:
        raise CheckpointCorruptError(f"sha256 mismatch in {entry.path}")
    return buf


@contextlib.contextmanager
def _missing_is_corrupt() -> Iterator[None]:
    try:
        yield
    except FileNotFoundError as exc:
        raise CheckpointCorruptError(f"a file is missing: {exc}") from exc


def verify_files(storage: CheckpointStorage, manifest: Manifest, chunk_bytes: int = 8 << 20) -> None:
    """Raise :class:`CheckpointCorruptError` unless every file has its manifest size and sha256."""
    with _missing_is_corrupt():
        _check_sizes(storage, manifest)
        for entry in manifest.files:
            _read_into(storage, manifest, entry, chunk_bytes, keep=False)


def read_pack(
    storage: CheckpointStorage, manifest: Manifest, *, weights_only: bool, chunk_bytes: int = 8 << 20
) -> Any:
    """Verify and decode a replicated (pack) snapshot in one read of each file."""
    if manifest.kind != SnapshotKind.PACK:
        raise CheckpointLoadError(f"snapshot step {manifest.step} is of kind {manifest.kind.value}, not pack")
    by_name = {entry.path.rsplit("/", 1)[-1]: entry for entry in manifest.files}
    missing = {SKELETON_NAME, TENSORS_NAME} - set(by_name)
    if missing:
        raise CheckpointCorruptError(f"manifest lacks {', '.join(sorted(missing))}")
    with _missing_is_corrupt():
        _check_sizes(storage, manifest)
        skeleton = _read_into(storage, manifest, by_name[SKELETON_NAME], chunk_bytes, True)
        tensors = _read_into(storage, manifest, by_name[TENSORS_NAME], chunk_bytes, True)
    try:
        return decode_pack(bytes(skeleton), tensors, weights_only=weights_only)
    except PackDecodeError as exc:
        raise CheckpointLoadError(
            f"snapshot step {manifest.step} is intact but does not decode: {exc}"
        ) from exc
