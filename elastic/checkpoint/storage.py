"""Storage back-ends for snapshots: POSIX directories (local, NFS, Lustre) and any fsspec filesystem.

Both offer the two write primitives the commit protocol rests on: durable data files and an atomic
``publish`` of a small file (the manifest).  POSIX gets it from ``write tmp + fsync + rename + fsync dir``;
object stores (S3, GCS, ...) from a single PUT, which is atomic there.  fsspec's own local filesystem
does not fsync, which is why local paths use :class:`LocalStorage` (plain ``os`` calls) instead.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from elastic.checkpoint.api import CheckpointStorageError, EventHook
from elastic.checkpoint.filesystems import drop_cached_pages, filesystem_type, is_network_filesystem
from elastic.checkpoint.lustre import apply_striping
from elastic.checkpoint.verification import VerifyMode

__all__ = [
    "BinaryReader",
    "BinaryWriter",
    "CheckpointStorage",
    "FsspecStorage",
    "LocalStorage",
    "StripeSettings",
    "create_storage",
    "describe_storage_failure",
]

logger = logging.getLogger(__name__)

# Object stores: directories are implicit and a single PUT is atomic; never create buckets.
_OBJECT_STORE_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "r2"})


class BinaryWriter(Protocol):
    def write(self, data: Any, /) -> int | None: ...


class BinaryReader(Protocol):
    def read(self, size: int = -1, /) -> bytes: ...

    def readinto(self, buffer: Any, /) -> int | None: ...


class CheckpointStorage(ABC):
    """A root under which snapshot files are stored; paths are relative, ``/``-separated.

    Contract:
    - ``open_write(rel)``: the file is complete and durable once the context exits without error
      (fsync on POSIX, completed upload on object stores); after an error its content is undefined.
    - ``publish(rel, data)``: atomically replaces ``rel``; a reader sees the old content, none, or all of
      ``data``, never a part, also across a crash of the writer.
    - ``list_sizes(prefix)``: every file under ``prefix`` with its size, fresh (no stale listing cache).
    - ``delete_tree``/``delete_file`` tolerate missing paths.
    - ``probe()`` raises :class:`CheckpointStorageError` (one line) unless the root can be written,
      read and deleted.
    Other failures propagate as the back-end's exceptions; callers wrap them.
    """

    events: EventHook | None = None

    @property
    @abstractmethod
    def url(self) -> str: ...

    @abstractmethod
    def prepare_root(self) -> None:
        """Create the root where that is needed (never a bucket) and apply layout settings."""

    @abstractmethod
    def make_dirs(self, rel: str) -> None: ...

    @abstractmethod
    def open_write(self, rel: str) -> contextlib.AbstractContextManager[BinaryWriter]: ...

    @abstractmethod
    def publish(self, rel: str, data: bytes) -> None: ...

    @abstractmethod
    def open_read(self, rel: str) -> contextlib.AbstractContextManager[BinaryReader]: ...

    def open_read_uncached(self, rel: str) -> contextlib.AbstractContextManager[BinaryReader]:
        """Like :meth:`open_read`, but the bytes come from the medium, not from a cache on this host.  The
        default suits back-ends without such a cache (object stores: every read is a request to the store);
        :class:`LocalStorage` drops the file's cached pages first."""
        return self.open_read(rel)

    @property
    def auto_verify_mode(self) -> VerifyMode:
        """What ``verify_after_write="auto"`` means here (see :mod:`elastic.checkpoint.verification`)."""
        return VerifyMode.SIZE

    def resolve_verify_mode(self, mode: VerifyMode) -> VerifyMode:
        """``mode``, with ``auto`` replaced by :attr:`auto_verify_mode`."""
        return self.auto_verify_mode if mode is VerifyMode.AUTO else mode

    @abstractmethod
    def read_bytes(self, rel: str) -> bytes: ...

    @abstractmethod
    def list_sizes(self, prefix: str = "") -> dict[str, int]: ...

    @abstractmethod
    def list_children(self, prefix: str = "") -> list[str]:
        """Names directly under ``prefix`` (files and directories); empty when it does not exist."""

    @abstractmethod
    def delete_file(self, rel: str) -> None: ...

    @abstractmethod
    def delete_tree(self, rel: str) -> None: ...

    @abstractmethod
    def full_path(self, rel: str) -> str:
        """The back-end path of ``rel`` (a filesystem path, or an fsspec URL)."""

    def _event(self, name: str) -> None:
        if self.events is not None:
            self.events(name)

    def probe(self) -> None:
        name = f".probe-{uuid.uuid4().hex[:12]}"
        try:
            self.prepare_root()
            self.publish(name, b"elastic-train storage probe")
            if self.read_bytes(name) != b"elastic-train storage probe":
                raise OSError("probe file read back with different content")
            self.delete_file(name)
        except CheckpointStorageError:
            raise
        except Exception as exc:
            raise CheckpointStorageError(
                f"checkpoint storage {self.url} is not usable: {describe_storage_failure(exc)}"
            ) from exc


def describe_storage_failure(exc: BaseException) -> str:
    """A one-line reason for a storage failure, naming the usual misconfigurations."""
    name = type(exc).__name__
    text = " ".join(str(exc).split()) or name
    if name in ("NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"):
        return (
            "no credentials found (set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE, "
            f"or pass key/secret in storage_options): {text}"
        )
    if name in ("EndpointConnectionError", "ConnectTimeoutError", "ClientConnectorError") or isinstance(
        exc, ConnectionError
    ):
        return f"cannot connect to the storage endpoint: {text}"
    if isinstance(exc, FileNotFoundError) and "bucket" in text.lower():
        return f"the bucket does not exist: {text}"
    if isinstance(exc, PermissionError) or getattr(exc, "errno", None) in (
        errno.EACCES,
        errno.EPERM,
        errno.EROFS,
    ):
        return f"not writable (permission denied or read-only): {text}"
    if isinstance(exc, (NotADirectoryError, FileExistsError)):
        return f"a path component is not a directory: {text}"
    if isinstance(exc, FileNotFoundError):
        return f"path does not exist and cannot be created: {text}"
    return f"{name}: {text}"


@dataclass(frozen=True)
class StripeSettings:
    """Lustre striping wanted for a local root (applied once, when ``lfs`` exists)."""

    enabled: bool
    count: int
    size: str


class _RawFileWriter:
    """Unbuffered writes that loop over short writes (no extra copy of large buffers)."""

    def __init__(self, fd: int) -> None:
        self._fd = fd

    def write(self, data: Any, /) -> int:
        view = memoryview(data).cast("B")
        total = len(view)
        done = 0
        while done < total:
            done += os.write(self._fd, view[done:])
        return total


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStorage(CheckpointStorage):
    """A POSIX directory (local disk, NFS, Lustre): fsync'd files and directories, rename to commit."""

    def __init__(self, root: str | Path, stripe: StripeSettings | None = None, url: str | None = None) -> None:
        self._root = Path(root).absolute()
        self._url = url or str(self._root)
        self._stripe = stripe
        self._striped = False
        self._fs_type: str | None = None

    @property
    def url(self) -> str:
        return self._url

    @property
    def root(self) -> Path:
        return self._root

    def _path(self, rel: str) -> Path:
        return self._root / rel if rel else self._root

    def full_path(self, rel: str) -> str:
        return str(self._path(rel))

    def prepare_root(self) -> None:
        self._makedirs(self._root)
        if self._stripe is not None and self._stripe.enabled and not self._striped:
            apply_striping(self._root, self._stripe.count, self._stripe.size)
            self._striped = True

    def _makedirs(self, path: Path) -> None:
        missing = []
        probe = path
        while not probe.exists():
            missing.append(probe)
            probe = probe.parent
        for directory in reversed(missing):
            with contextlib.suppress(FileExistsError):
                directory.mkdir()
            _fsync_dir(directory.parent)  # make the new entry durable
        if not path.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(path))

    def make_dirs(self, rel: str) -> None:
        self._makedirs(self._path(rel))

    @contextlib.contextmanager
    def open_write(self, rel: str) -> Iterator[BinaryWriter]:
        path = self._path(rel)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            yield _RawFileWriter(fd)
            os.fsync(fd)
        finally:
            os.close(fd)
        _fsync_dir(path.parent)

    def publish(self, rel: str, data: bytes) -> None:
        path = self._path(rel)
        tmp = path.with_name(f"{path.name}.tmp-{uuid.uuid4().hex[:12]}")
        try:
            with self.open_write(str(tmp.relative_to(self._root))) as out:
                out.write(data)
            self._event("publish_tmp_written")
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        _fsync_dir(path.parent)

    @contextlib.contextmanager
    def open_read(self, rel: str) -> Iterator[BinaryReader]:
        with open(self._path(rel), "rb", buffering=0) as f:
            yield f

    @contextlib.contextmanager
    def open_read_uncached(self, rel: str) -> Iterator[BinaryReader]:
        """The file's cached pages are dropped before reading (the read reaches the medium) and again after
        (a verification's read-back need not stay in memory); see :func:`drop_cached_pages`."""
        with open(self._path(rel), "rb", buffering=0) as f:
            drop_cached_pages(f.fileno())
            try:
                yield f
            finally:
                drop_cached_pages(f.fileno())

    @property
    def auto_verify_mode(self) -> VerifyMode:
        """``size`` on a local file system (a read-back would read the page cache); ``read_back_uncached`` on a
        network file system (Lustre, NFS, ...) or a FUSE mount, where it reads what the servers hold."""
        if self._fs_type is None:
            self._fs_type = filesystem_type(self._root) or "unknown"
            logger.debug("checkpoint root %s is on a %s file system", self._root, self._fs_type)
        if is_network_filesystem(self._fs_type):
            return VerifyMode.READ_BACK_UNCACHED
        return VerifyMode.SIZE

    def read_bytes(self, rel: str) -> bytes:
        return self._path(rel).read_bytes()

    def list_sizes(self, prefix: str = "") -> dict[str, int]:
        base = self._path(prefix)
        out: dict[str, int] = {}
        if not base.is_dir():
            return out
        for dirpath, _dirs, files in os.walk(base):
            for name in files:
                full = Path(dirpath) / name
                with contextlib.suppress(FileNotFoundError):
                    out[str(full.relative_to(base)).replace(os.sep, "/")] = full.stat().st_size
        return out

    def list_children(self, prefix: str = "") -> list[str]:
        try:
            return sorted(os.listdir(self._path(prefix)))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def delete_file(self, rel: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._path(rel).unlink()

    def delete_tree(self, rel: str) -> None:
        path = self._path(rel)
        if not path.exists():
            return
        for dirpath, dirs, files in os.walk(path, topdown=False):
            for name in files:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(dirpath, name))
            for name in dirs:
                with contextlib.suppress(FileNotFoundError):
                    os.rmdir(os.path.join(dirpath, name))
        with contextlib.suppress(FileNotFoundError):
            os.rmdir(path)


class FsspecStorage(CheckpointStorage):
    """Any fsspec filesystem (``s3://`` through s3fs, ``memory://``, ...): publish is one whole-file write."""

    def __init__(self, fs: Any, root: str, url: str) -> None:
        self._fs = fs
        self._root = root.rstrip("/")
        self._url = url
        protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
        self._object_store = bool(_OBJECT_STORE_PROTOCOLS.intersection(protocols))

    @property
    def url(self) -> str:
        return self._url

    @property
    def fs(self) -> Any:
        return self._fs

    @property
    def is_object_store(self) -> bool:
        return self._object_store

    @property
    def auto_verify_mode(self) -> VerifyMode:
        """``read_back_uncached`` on object stores (every read is a GET: it proves what the store holds);
        ``size`` elsewhere (``memory://``: the bytes never left this process)."""
        return VerifyMode.READ_BACK_UNCACHED if self._object_store else VerifyMode.SIZE

    def _path(self, rel: str) -> str:
        return f"{self._root}/{rel}" if rel else self._root

    def full_path(self, rel: str) -> str:
        return str(self._fs.unstrip_protocol(self._path(rel)))

    def prepare_root(self) -> None:
        if not self._object_store:
            self._fs.makedirs(self._root, exist_ok=True)

    def make_dirs(self, rel: str) -> None:
        if not self._object_store:
            self._fs.makedirs(self._path(rel), exist_ok=True)

    @contextlib.contextmanager
    def open_write(self, rel: str) -> Iterator[BinaryWriter]:
        f = self._fs.open(self._path(rel), "wb")
        try:
            yield f
        except BaseException:
            discard = getattr(f, "discard", None)
            with contextlib.suppress(Exception):
                if discard is not None:
                    discard()  # abort a multipart upload instead of completing a partial object
                else:
                    f.close()
            raise
        f.close()

    def publish(self, rel: str, data: bytes) -> None:
        self._fs.pipe_file(self._path(rel), data)

    @contextlib.contextmanager
    def open_read(self, rel: str) -> Iterator[BinaryReader]:
        with self._fs.open(self._path(rel), "rb") as f:
            yield f

    def read_bytes(self, rel: str) -> bytes:
        return bytes(self._fs.cat_file(self._path(rel)))

    def list_sizes(self, prefix: str = "") -> dict[str, int]:
        base = self._path(prefix)
        self._fs.invalidate_cache()
        try:
            found = self._fs.find(base, detail=True)
        except FileNotFoundError:
            return {}
        out: dict[str, int] = {}
        strip = base.rstrip("/") + "/"
        for name, info in found.items():
            if info.get("type", "file") != "file":
                continue
            if name.startswith(strip):
                out[name[len(strip) :]] = int(info.get("size") or 0)
        return out

    def list_children(self, prefix: str = "") -> list[str]:
        self._fs.invalidate_cache()
        try:
            names = self._fs.ls(self._path(prefix), detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted({str(n).rstrip("/").rsplit("/", 1)[-1] for n in names})

    def delete_file(self, rel: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._fs.rm_file(self._path(rel))

    def delete_tree(self, rel: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._fs.rm(self._path(rel), recursive=True)


def create_storage(
    url: str,
    storage_options: Mapping[str, Any] | None = None,
    stripe: StripeSettings | None = None,
) -> CheckpointStorage:
    """The storage for ``url`` (plain path, ``file://``, ``s3://``, ``memory://``, any fsspec protocol).

    Nothing is contacted here; bad URLs and missing fsspec back-ends raise
    :class:`CheckpointStorageError`.  Use ``probe()`` to check access.
    """
    if not url or not url.strip():
        raise CheckpointStorageError("checkpoint storage URL is empty")
    import fsspec.core

    try:
        fs, path = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
    except ImportError as exc:
        raise CheckpointStorageError(
            f"checkpoint storage {url} needs a missing fsspec back-end ({exc}); for s3:// install s3fs"
        ) from exc
    except (ValueError, TypeError) as exc:
        raise CheckpointStorageError(f"checkpoint storage {url} is not a usable URL: {exc}") from exc
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    if "file" in protocols or "local" in protocols:
        return LocalStorage(path, stripe=stripe, url=url)
    if not str(path).strip("/"):
        raise CheckpointStorageError(f"checkpoint storage {url} names no bucket or directory")
    return FsspecStorage(fs, str(path), url)
