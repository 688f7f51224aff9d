"""The digest algorithms of snapshot files: one home for which exist, how they are made and checked.

New snapshots hash their files with **BLAKE3** (the ``blake3`` package: cryptographic like SHA-256, but
SIMD and optionally multi-threaded; measured on a 2-core x86 VM: 4.6 GB/s on one core against SHA-256's
1.4 GB/s, see docs/benchmarks.md).  **SHA-256** stays readable forever: every snapshot written before
BLAKE3 names its files' SHA-256 digests, and ``digest_algorithm="sha256"`` still writes such snapshots
(in the old manifest format, which older releases can load).

Both release the GIL while hashing a large buffer (``hashlib`` above 2 KiB, ``blake3`` above its own
threshold), so the I/O threads hash in parallel.  The manifest's own checksum and HMAC stay SHA-256 (see
:mod:`elastic.checkpoint.layout`): they cover a few KiB, and keeping them fixed means a manifest can be
checked before anything in it, its algorithm names included, is believed.
"""

from __future__ import annotations

import enum
import hashlib
import re
from typing import Any, Protocol

import blake3

__all__ = [
    "DEFAULT_DIGEST",
    "DigestAlgorithm",
    "Hasher",
    "check_hex_digest",
    "digest_bytes",
    "new_hasher",
    "parse_algorithm",
]

_HEX_LENGTH = 64  # both produce 32 bytes (BLAKE3's default output length)


class DigestAlgorithm(str, enum.Enum):
    """The digest of a snapshot file, as named in manifests (``"sha256"``, ``"blake3"``)."""

    SHA256 = "sha256"
    BLAKE3 = "blake3"

    @property
    def hex_length(self) -> int:
        """Characters of a valid lowercase hex digest of this algorithm."""
        return _HEX_LENGTH


#: What new snapshots use unless ``CheckpointOptions.digest_algorithm`` says otherwise.
DEFAULT_DIGEST = DigestAlgorithm.BLAKE3


class Hasher(Protocol):
    """What :func:`new_hasher` returns (``hashlib`` and ``blake3`` objects both fit)."""

    def update(self, data: Any, /) -> Any: ...

    def hexdigest(self) -> str: ...


def parse_algorithm(value: object) -> DigestAlgorithm:
    """``value`` as a :class:`DigestAlgorithm`; ``ValueError`` naming the known ones otherwise."""
    if isinstance(value, DigestAlgorithm):
        return value
    try:
        return DigestAlgorithm(value)
    except ValueError:
        known = ", ".join(a.value for a in DigestAlgorithm)
        raise ValueError(f"unknown digest algorithm {value!r} (known: {known})") from None


def new_hasher(algorithm: DigestAlgorithm, *, threads: int = 1) -> Hasher:
    """A fresh hasher.  ``threads`` (BLAKE3 only; ``-1``: as many as blake3 sees fit): threads one
    ``update`` may use.  The writer and reader hash many files at once on their own I/O threads and keep
    the default of 1; a single large buffer hashed alone profits from more."""
    if algorithm is DigestAlgorithm.BLAKE3:
        return blake3.blake3(max_threads=blake3.blake3.AUTO if threads == -1 else max(1, threads))
    if algorithm is DigestAlgorithm.SHA256:
        return hashlib.sha256()
    raise ValueError(f"unknown digest algorithm {algorithm!r}")  # unreachable for a DigestAlgorithm


def digest_bytes(algorithm: DigestAlgorithm, data: Any) -> str:
    """The hex digest of one buffer."""
    hasher = new_hasher(algorithm)
    hasher.update(data)
    return hasher.hexdigest()


def check_hex_digest(algorithm: DigestAlgorithm, digest: str) -> bool:
    """Whether ``digest`` is a well-formed lowercase hex digest of ``algorithm``."""
    return re.fullmatch(f"[0-9a-f]{{{algorithm.hex_length}}}", digest) is not None
