"""Where the tensor bytes of a pack snapshot go: segment files cut at fixed offsets; pure, no I/O.

The tensors of a replicated snapshot form one logical byte stream (the 64-byte aligned layout of
:func:`elastic.checkpoint.codec.tensor_layout`).  It is stored as segment files ``tensors-00000.bin``,
``tensors-00001.bin``, ... of ``segment_bytes`` each (the last one shorter), cut at fixed offsets whatever
the tensor boundaries, so a tensor may span segments.  Each segment is written, hashed and read back on its
own (in parallel), and has its own size and digest in the manifest.  Snapshots written before segments
existed hold the same stream in one file, ``tensors.bin``; readers accept both.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "LEGACY_TENSORS_NAME",
    "Extent",
    "Segment",
    "plan_segments",
    "segment_extents",
    "segment_index",
    "segment_name",
    "split_chunks",
    "tensor_file_order",
]

LEGACY_TENSORS_NAME = "tensors.bin"
_SEGMENT_RE = re.compile(r"^tensors-(\d{5,})\.bin$")


def segment_name(index: int) -> str:
    """File name of segment ``index`` (``tensors-00000.bin``; sorts by index up to 100000 segments)."""
    if index < 0:
        raise ValueError(f"segment index must be >= 0, got {index}")
    return f"tensors-{index:05d}.bin"


def segment_index(name: str) -> int | None:
    """The index of a segment file name, or ``None`` for any other name."""
    match = _SEGMENT_RE.match(name)
    return int(match.group(1)) if match else None


@dataclass(frozen=True)
class Segment:
    """Bytes ``[start, stop)`` of the logical tensor stream, stored as file :func:`segment_name` (index)."""

    index: int
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start

    @property
    def name(self) -> str:
        return segment_name(self.index)


def plan_segments(total: int, segment_bytes: int) -> list[Segment]:
    """Cut ``total`` bytes into segments of ``segment_bytes`` (the last one shorter).

    Always at least one segment: an empty stream (a state without tensor data) is one empty file, so
    every pack snapshot names its tensor data in the manifest.
    """
    if total < 0 or segment_bytes < 1:
        raise ValueError(f"bad segment plan: total={total}, segment_bytes={segment_bytes}")
    if total == 0:
        return [Segment(0, 0, 0)]
    return [
        Segment(i, start, min(start + segment_bytes, total)) for i, start in enumerate(range(0, total, segment_bytes))
    ]


@dataclass(frozen=True)
class Extent:
    """A run of bytes of one segment: ``length`` bytes from ``offset`` into tensor ``tensor`` (its flat
    byte view), or ``length`` zero bytes of alignment padding when ``tensor`` is ``None``."""

    tensor: int | None
    offset: int
    length: int


def segment_extents(table: Sequence[Mapping[str, Any]], segment: Segment) -> list[Extent]:
    """The tensor bytes and padding that make up ``segment``, in order; their lengths sum to its size.

    ``table`` is :func:`~elastic.checkpoint.codec.tensor_layout`'s (``offset``/``nbytes`` per tensor, in
    stream order); gaps between tensors are zero padding.
    """
    out: list[Extent] = []
    pos = segment.start
    for index, entry in enumerate(table):
        begin, nbytes = int(entry["offset"]), int(entry["nbytes"])
        end = begin + nbytes
        if nbytes == 0 or end <= pos:
            continue
        if begin > pos:  # alignment padding before this tensor, possibly ending this segment
            gap_end = min(begin, segment.stop)
            out.append(Extent(None, 0, gap_end - pos))
            pos = gap_end
            if pos >= segment.stop:
                break
        take = min(end, segment.stop) - pos
        out.append(Extent(index, pos - begin, take))
        pos += take
        if pos >= segment.stop:
            break
    if pos < segment.stop:
        raise ValueError(f"layout ends at {pos}, before segment {segment.index} ends at {segment.stop}")
    return out


def split_chunks(extents: Iterable[Extent], chunk_bytes: int) -> Iterator[Extent]:
    """``extents`` cut into pieces of at most ``chunk_bytes`` (the unit of I/O, hashing and events)."""
    for extent in extents:
        for start in range(0, extent.length, chunk_bytes):
            yield Extent(extent.tensor, extent.offset + start, min(chunk_bytes, extent.length - start))


def tensor_file_order(names: Iterable[str]) -> list[str]:
    """The tensor data files among a pack manifest's file names, in stream order.

    Either the legacy single ``tensors.bin`` or segments ``tensors-00000.bin`` ... numbered without gaps;
    anything else is a defective manifest (``ValueError`` saying why).  Other names (the skeleton) are
    ignored.
    """
    names = list(names)
    legacy = LEGACY_TENSORS_NAME in names
    segments = sorted((i, n) for n in names if (i := segment_index(n)) is not None)
    if legacy and segments:
        raise ValueError(f"manifest lists both {LEGACY_TENSORS_NAME} and segment files")
    if legacy:
        return [LEGACY_TENSORS_NAME]
    if not segments:
        raise ValueError("manifest lists no tensor data file")
    for expected, (index, name) in enumerate(segments):
        if index != expected:
            raise ValueError(f"manifest lacks tensor segment {segment_name(expected)} (next is {name})")
    return [name for _, name in segments]
