"""Where snapshot files live and what a manifest says; pure functions, no I/O.

Layout under the root (``/`` separated, relative paths)::

    step-000000001200/manifest.json          the commit point (written last)
    step-000000001200/<token>/skeleton.pt    data of one save attempt (token = unique per attempt)
    step-000000001200/<token>/tensors-00000.bin, tensors-00001.bin, ...   (older snapshots: tensors.bin)

A save attempt writes only inside its own ``<token>/`` directory, so an attempt that dies half-way can
never damage a committed snapshot, even one of the same step; committing replaces ``manifest.json``
atomically, and the files it names are the snapshot.

Manifest formats: version 1 names every file's SHA-256 (``{"path", "size", "sha256"}``), as every snapshot
written before BLAKE3 does; version 2 names each file's algorithm and digest
(``{"path", "size", "algorithm", "digest"}``, see :mod:`elastic.checkpoint.digest`).  A manifest whose
files are all SHA-256 is written as version 1, so older releases still read it; both versions are read.
The manifest's own checksum (``manifest_sha256``) and signature (``manifest_hmac``) are SHA-256 in both.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from elastic.checkpoint.digest import DigestAlgorithm, check_hex_digest, parse_algorithm

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "SUPPORTED_FORMAT_VERSIONS",
    "FileEntry",
    "Manifest",
    "ManifestError",
    "ManifestSignatureError",
    "SnapshotKind",
    "garbage_step_dirs",
    "listing_problems",
    "manifest_path",
    "parse_step_dir",
    "plan_retention",
    "step_dir",
    "writer_rank_for",
]

FORMAT_VERSION = 2  # the newest format; manifests of SHA-256 files are still written as version 1
SUPPORTED_FORMAT_VERSIONS = (1, 2)
MANIFEST_NAME = "manifest.json"
_STEP_DIR_RE = re.compile(r"^step-(\d{12,})$")
_TOKEN_RE = re.compile(r"^[0-9a-f]{8,64}$")


class ManifestError(ValueError):
    """A manifest is unreadable, inconsistent, or of an unknown format version."""


class ManifestSignatureError(ManifestError):
    """A well-formed manifest not signed with the reader's key: another writer's snapshot, left alone."""


class SnapshotKind(str, enum.Enum):
    """How the data files of a snapshot are encoded."""

    PACK = "pack"  # replicated state: skeleton.pt + tensor segments (see codec.py, segments.py)
    DCP = "dcp"  # sharded state: torch.distributed.checkpoint files + .metadata


def step_dir(step: int) -> str:
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step-{step:012d}"


def manifest_path(step: int) -> str:
    return f"{step_dir(step)}/{MANIFEST_NAME}"


def parse_step_dir(name: str) -> int | None:
    """The step of a ``step-<digits>`` directory name, or ``None`` for any other name."""
    match = _STEP_DIR_RE.match(name)
    return int(match.group(1)) if match else None


def writer_rank_for(world_size: int, configured: int = 0) -> int:
    """The rank that writes replicated state: ``configured`` (default 0) of the saving world.

    Deterministic so that every rank agrees without talking; a configured rank outside the world
    falls back to rank 0.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return configured if 0 <= configured < world_size else 0


@dataclass(frozen=True)
class FileEntry:
    """One data file of a snapshot, relative to its step directory, with its ``digest`` (lowercase hex) by
    ``algorithm`` (SHA-256 unless said: the only one snapshots before BLAKE3 knew)."""

    path: str
    size: int
    digest: str
    algorithm: DigestAlgorithm = DigestAlgorithm.SHA256

    def to_dict(self) -> dict[str, Any]:
        """The entry as a manifest (or a sharded save's part file) stores it; SHA-256 in the version 1 form."""
        if self.algorithm is DigestAlgorithm.SHA256:
            return {"path": self.path, "size": self.size, "sha256": self.digest}
        return {"path": self.path, "size": self.size, "algorithm": self.algorithm.value, "digest": self.digest}

    @classmethod
    def from_dict(cls, item: Any, *, format_version: int = FORMAT_VERSION) -> FileEntry:
        """Parse one stored entry; :class:`ManifestError` names what is wrong (unknown algorithm, a digest
        of the wrong length for its algorithm, missing fields)."""
        if not isinstance(item, dict):
            raise ManifestError(f"manifest file entry {item!r} is not an object")
        path = item.get("path")
        size = item.get("size")
        if not isinstance(path, str) or not isinstance(size, int) or isinstance(size, bool):
            raise ManifestError(f"manifest file entry {item!r} lacks a path or a size")
        if "sha256" in item and "algorithm" not in item and "digest" not in item:
            algorithm, digest = DigestAlgorithm.SHA256, item["sha256"]
        elif format_version >= 2 and "algorithm" in item and "digest" in item and "sha256" not in item:
            try:
                algorithm = parse_algorithm(item["algorithm"])
            except ValueError as exc:
                raise ManifestError(f"manifest entry for {path!r}: {exc}") from None
            digest = item["digest"]
        else:
            want = "sha256" if format_version < 2 else "sha256, or algorithm and digest"
            raise ManifestError(f"manifest entry for {path!r} must name {want} (format_version {format_version})")
        if not isinstance(digest, str) or not check_hex_digest(algorithm, digest):
            raise ManifestError(
                f"manifest entry for {path!r}: {algorithm.value} digest must be {algorithm.hex_length} lowercase "
                f"hex characters, got {digest!r}"
            )
        return cls(path=path, size=size, digest=digest, algorithm=algorithm)


@dataclass(frozen=True)
class Manifest:
    """What a committed snapshot consists of.  ``to_json`` adds a checksum of the manifest itself and, given
    a key, an HMAC-SHA256 of it: with the key, ``from_json`` accepts only manifests signed with that key, so
    whoever can write the storage but does not hold the job's key cannot make the job load their files
    (the digest of every file is in the signed body)."""

    step: int
    token: str
    kind: SnapshotKind
    files: tuple[FileEntry, ...]
    created_unix: float
    world_size: int
    writer_rank: int
    meta: Mapping[str, str] = field(default_factory=dict)

    @property
    def format_version(self) -> int:
        """1 when every file is SHA-256 (readable by releases before BLAKE3), else 2."""
        return 1 if all(f.algorithm is DigestAlgorithm.SHA256 for f in self.files) else FORMAT_VERSION

    def _body(self) -> dict[str, Any]:
        return {
            "format_version": self.format_version,
            "kind": self.kind.value,
            "step": self.step,
            "token": self.token,
            "created_unix": self.created_unix,
            "world_size": self.world_size,
            "writer_rank": self.writer_rank,
            "files": [f.to_dict() for f in self.files],
            "meta": dict(sorted(self.meta.items())),
        }

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def to_json(self, key: bytes | None = None) -> bytes:
        body = self._body()
        canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
        body["manifest_sha256"] = hashlib.sha256(canonical).hexdigest()
        if key is not None:
            body["manifest_hmac"] = hmac.new(key, canonical, hashlib.sha256).hexdigest()
        return json.dumps(body, sort_keys=True, indent=1).encode() + b"\n"

    @classmethod
    def from_json(cls, data: bytes, *, expected_step: int | None = None, key: bytes | None = None) -> Manifest:
        """Parse and check a manifest (with ``key``: and its signature); any defect raises
        :class:`ManifestError`."""
        try:
            body = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ManifestError(f"manifest is not valid JSON ({exc})") from exc
        if not isinstance(body, dict):
            raise ManifestError("manifest is not a JSON object")
        claimed = body.pop("manifest_sha256", None)
        signature = body.pop("manifest_hmac", None)
        canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
        if claimed != hashlib.sha256(canonical).hexdigest():
            raise ManifestError("manifest checksum mismatch")
        if key is not None:
            if not isinstance(signature, str):
                raise ManifestSignatureError("manifest is not signed (this job's are: not written by this job?)")
            if not hmac.compare_digest(signature, hmac.new(key, canonical, hashlib.sha256).hexdigest()):
                raise ManifestSignatureError("manifest signature does not match this job's key (another job's?)")
        version = body.get("format_version")
        if version not in SUPPORTED_FORMAT_VERSIONS or isinstance(version, bool):
            raise ManifestError(f"unsupported manifest format_version {version!r}")
        files = body.get("files")
        if not isinstance(files, list):
            raise ManifestError("manifest field 'files' missing or not a list")
        entries = tuple(FileEntry.from_dict(f, format_version=version) for f in files)
        try:
            manifest = cls(
                step=int(body["step"]),
                token=str(body["token"]),
                kind=SnapshotKind(body["kind"]),
                files=entries,
                created_unix=float(body["created_unix"]),
                world_size=int(body["world_size"]),
                writer_rank=int(body["writer_rank"]),
                meta={str(k): str(v) for k, v in body.get("meta", {}).items()},
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ManifestError(f"manifest field missing or malformed ({exc!r})") from exc
        manifest._check(expected_step)
        return manifest

    def _check(self, expected_step: int | None) -> None:
        if expected_step is not None and self.step != expected_step:
            raise ManifestError(f"manifest says step {self.step} inside {step_dir(expected_step)}")
        if not _TOKEN_RE.match(self.token):
            raise ManifestError(f"manifest token {self.token!r} is malformed")
        if not self.files:
            raise ManifestError("manifest lists no files")
        seen: set[str] = set()
        for entry in self.files:
            parts = entry.path.split("/")
            if parts[0] != self.token or len(parts) < 2 or any(p in ("", ".", "..") for p in parts):
                raise ManifestError(f"manifest file path {entry.path!r} is outside the snapshot's directory")
            if entry.size < 0 or not check_hex_digest(entry.algorithm, entry.digest):
                raise ManifestError(f"manifest entry for {entry.path!r} is malformed")
            if entry.path in seen:
                raise ManifestError(f"manifest lists {entry.path!r} twice")
            seen.add(entry.path)


def listing_problems(manifest: Manifest, sizes: Mapping[str, int]) -> list[str]:
    """Files of ``manifest`` missing from ``sizes`` (paths relative to the step dir) or of another size."""
    problems = []
    for entry in manifest.files:
        actual = sizes.get(entry.path)
        if actual is None:
            problems.append(f"{entry.path} is missing")
        elif actual != entry.size:
            problems.append(f"{entry.path} has {actual} bytes, manifest says {entry.size}")
    return problems


def plan_retention(
    committed_steps: Iterable[int],
    just_written: int,
    keep_last: int,
    keep_every: int | None = None,
) -> list[int]:
    """Steps to delete after ``just_written`` was committed and verified.

    Only snapshots older than ``just_written`` are candidates (it is the newest valid one, and anything
    newer was not written by this run and is left alone).  ``just_written`` counts as one of
    ``keep_last``; steps that are multiples of ``keep_every`` are kept as well.
    """
    if keep_last < 1:
        raise ValueError("keep_last must be >= 1")
    older = sorted({s for s in committed_steps if s < just_written}, reverse=True)
    keep = set(older[: keep_last - 1])
    if keep_every:
        keep |= {s for s in older if s % keep_every == 0}
    return sorted(s for s in older if s not in keep)


def garbage_step_dirs(step_dirs: Sequence[int], committed_steps: Iterable[int], just_written: int) -> list[int]:
    """Step directories without a valid manifest that are older than ``just_written`` (dead attempts)."""
    committed = set(committed_steps)
    return sorted(s for s in set(step_dirs) if s < just_written and s not in committed)
