"""How a new snapshot is checked right after it is written (``CheckpointOptions.verify_after_write``).

A check after writing should cost what it proves.  Re-reading a file just written to a local file system
reads the page cache, the very memory it was written from: it re-hashes the bytes already hashed while
writing, doubles the save's CPU time and proves next to nothing about the disk.  So:

==========================  =====================================================================================
``none``                    nothing (the data was hashed from memory while it was written; the load verifies)
``size``                    one listing: every file of the manifest exists with its size (catches missing and
                            truncated files, e.g. a full disk or quota that lost a write)
``read_back``               every file re-read through the storage and its digest compared (on a local file
                            system this reads the page cache: the behaviour of the former ``True``)
``read_back_uncached``      every file re-read from the medium and its digest compared: on POSIX paths the
                            file's clean pages are dropped first (``posix_fadvise(DONTNEED)``; the files were
                            fsync'd) so the read reaches the disk or the file servers; on object stores every
                            read is a GET from the store anyway
``auto`` (default)          per storage kind (``CheckpointStorage.auto_verify_mode``): ``size`` on local file
                            systems (ext4, xfs, tmpfs, ...) and in-process ``memory://``; ``read_back_uncached``
                            on network file systems (Lustre, NFS, CephFS, GPFS, BeeGFS, SMB, FUSE mounts) and
                            object stores (S3, GCS, Azure), where the bytes went over a network to another
                            machine and a read-back proves they arrived whole
==========================  =====================================================================================

Loading always verifies every digest, whatever this setting.  The former ``bool`` values are still
accepted: ``True`` maps to ``read_back`` (the same work as before), ``False`` to ``none``.
"""

from __future__ import annotations

import enum

__all__ = ["VerifyMode", "parse_verify_mode"]


class VerifyMode(str, enum.Enum):
    """See the module docstring."""

    AUTO = "auto"
    NONE = "none"
    SIZE = "size"
    READ_BACK = "read_back"
    READ_BACK_UNCACHED = "read_back_uncached"

    @property
    def reads_data(self) -> bool:
        """Whether this mode re-reads and re-hashes the files (``auto`` must be resolved first)."""
        if self is VerifyMode.AUTO:
            raise ValueError("resolve verify mode 'auto' against the storage first")
        return self in (VerifyMode.READ_BACK, VerifyMode.READ_BACK_UNCACHED)


def parse_verify_mode(value: object) -> VerifyMode:
    """``value`` (a :class:`VerifyMode`, its name, or the former ``bool``) as a mode; ``ValueError`` otherwise."""
    if value is True:
        return VerifyMode.READ_BACK
    if value is False:
        return VerifyMode.NONE
    if isinstance(value, VerifyMode):
        return value
    if isinstance(value, str):
        try:
            return VerifyMode(value.strip().lower())
        except ValueError:
            pass
    known = ", ".join(m.value for m in VerifyMode)
    raise ValueError(f"verify_after_write must be one of {known} (or a bool: True = read_back), got {value!r}")
