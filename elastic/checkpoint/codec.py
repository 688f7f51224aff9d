"""Encoding of replicated state: a small ``skeleton.pt`` plus the raw tensor bytes in segment files.

Why not one ``torch.save`` file: ``torch.save`` into a Python stream copies each storage into a Python
``bytes`` object and computes a CRC32 with the GIL held, so a background writer thread would stall the
training thread for most of the write.  Here the structure (dicts, lists, numbers, strings, tensor
references) still goes through ``torch.save``/``torch.load(weights_only=True)``, but tensor data is written
straight from the tensors' memory in large chunks (``os.write`` and ``hashlib`` release the GIL) as one
64-byte aligned byte stream, cut into segment files (see :mod:`elastic.checkpoint.segments`), and read back
into one allocation per tensor (:func:`allocate_tensors` says why not one buffer for all).

Tensors are restored with the saved dtype, shape and bytes (bit-identical), contiguous, on the device the
loader reads into (CPU by default; 0-dimensional ones on CPU always); tensors that appear several times in the state
(tied weights) are restored as one tensor.  Tensors other than plain strided ones (sparse, quantized,
subclasses) are kept inside the skeleton and go through ``torch.save`` as they are (restored on CPU).
"""

from __future__ import annotations

import io
import math
import sys
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from elastic.checkpoint.segments import LEGACY_TENSORS_NAME, Segment, segment_extents, split_chunks
from elastic.checkpoint.tree import map_leaves

__all__ = [
    "PACK_FORMAT",
    "SKELETON_NAME",
    "TENSORS_NAME",
    "TENSOR_REF_KEY",
    "PackDecodeError",
    "PackSkeleton",
    "PackedTensor",
    "allocate_tensors",
    "encode_skeleton",
    "read_skeleton",
    "rebuild_state",
    "segment_chunks",
    "tensor_layout",
]

PACK_FORMAT = "elastic-pack/1"
SKELETON_NAME = "skeleton.pt"
TENSORS_NAME = LEGACY_TENSORS_NAME  # the single data file of snapshots written before segments
TENSOR_REF_KEY = "__elastic_tensor__"  # reserved dict key marking a tensor reference in the skeleton
_ALIGN = 64
_ZEROS = bytes(_ALIGN)


class PackDecodeError(ValueError):
    """Verified bytes that do not decode into a state (format mismatch, disallowed types)."""


def tensor_layout(tensors: list[torch.Tensor]) -> tuple[list[dict[str, Any]], int]:
    """Table of (dtype, shape, offset, nbytes) for ``tensors`` packed with 64-byte alignment, and the size."""
    table = []
    offset = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        offset = -(-offset // _ALIGN) * _ALIGN
        table.append(
            {
                "dtype": str(t.dtype).removeprefix("torch."),
                "shape": list(t.shape),
                "offset": offset,
                "nbytes": nbytes,
            }
        )
        offset += nbytes
    return table, offset


def encode_skeleton(skeleton: Any, tensors: list[torch.Tensor]) -> bytes:
    """The pack layout's ``skeleton.pt``: the state's structure and the table of its tensors' bytes."""
    table, total = tensor_layout(tensors)
    bundle = {
        "format": PACK_FORMAT,
        "byteorder": sys.byteorder,
        "tensors": table,
        "tensors_bytes": total,
        "skeleton": skeleton,
    }
    buf = io.BytesIO()
    torch.save(bundle, buf)
    return buf.getvalue()


def _byte_view(t: torch.Tensor) -> memoryview:
    return t.reshape(-1).view(torch.uint8).numpy().data


def segment_chunks(
    tensors: Sequence[torch.Tensor],
    table: Sequence[Mapping[str, Any]],
    segment: Segment,
    chunk_bytes: int,
) -> Iterator[memoryview]:
    """The bytes of ``segment`` of the packed stream, as views of the tensors' memory (no copies) and of
    zero padding, each at most ``chunk_bytes``.  ``table`` is ``tensor_layout(tensors)[0]``; the tensors
    must be contiguous CPU tensors and stay unchanged while the views are used."""
    views: dict[int, memoryview] = {}
    for extent in split_chunks(segment_extents(table, segment), chunk_bytes):
        if extent.tensor is None:
            yield memoryview(_ZEROS)[: extent.length]
            continue
        view = views.get(extent.tensor)
        if view is None:
            view = views[extent.tensor] = _byte_view(tensors[extent.tensor])
        yield view[extent.offset : extent.offset + extent.length]


@dataclass(frozen=True)
class PackedTensor:
    """One tensor of the stream, as the skeleton's table describes it."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def on_host(self) -> bool:
        """Restored on the CPU whatever the device: a 0-dimensional tensor (see :func:`read_skeleton`)."""
        return len(self.shape) == 0


@dataclass(frozen=True)
class PackSkeleton:
    """A decoded ``skeleton.pt``: the state's structure with tensor references, and the table of the tensors'
    bytes in the stream (``table``: the raw entries, as :func:`~elastic.checkpoint.segments.segment_extents`
    reads them; ``tensors``: the same, typed)."""

    structure: Any
    table: tuple[Mapping[str, Any], ...]
    tensors: tuple[PackedTensor, ...]
    total: int


def read_skeleton(skeleton_bytes: bytes, *, weights_only: bool = True) -> PackSkeleton:
    """The structure and tensor table of verified ``skeleton.pt`` bytes, checked to describe one gapless stream
    of 64-byte aligned tensors in order (as :func:`tensor_layout` writes it), so that every byte of the data
    files has one place to go.  Raises :class:`PackDecodeError`."""
    try:
        bundle = torch.load(io.BytesIO(skeleton_bytes), map_location="cpu", weights_only=weights_only)
    except Exception as exc:
        hint = " (set CheckpointOptions(weights_only=False) if you trust this storage)" if weights_only else ""
        raise PackDecodeError(f"skeleton does not load{hint}: {' '.join(str(exc).split())[:400]}") from exc
    if not isinstance(bundle, dict) or bundle.get("format") != PACK_FORMAT:
        raise PackDecodeError(f"skeleton is not in format {PACK_FORMAT}")
    if bundle.get("byteorder") != sys.byteorder:
        raise PackDecodeError(f"snapshot was written on a {bundle.get('byteorder')}-endian machine")
    total, table = bundle.get("tensors_bytes"), bundle.get("tensors")
    if not isinstance(total, int) or not isinstance(table, list):
        raise PackDecodeError("skeleton lacks its tensor table")
    tensors: list[PackedTensor] = []
    end = 0
    for entry in table:
        try:
            dtype = getattr(torch, entry["dtype"], None)
            shape, offset, nbytes = tuple(int(d) for d in entry["shape"]), int(entry["offset"]), int(entry["nbytes"])
        except (TypeError, KeyError, ValueError) as exc:
            raise PackDecodeError(f"malformed tensor table entry {entry!r:.200}") from exc
        if not isinstance(dtype, torch.dtype):
            raise PackDecodeError(f"unknown dtype {entry['dtype']!r}")
        if nbytes != math.prod(shape) * dtype.itemsize or min(shape, default=0) < 0:
            raise PackDecodeError(f"tensor of shape {list(shape)} and {dtype} cannot have {nbytes} bytes")
        if nbytes and (offset % _ALIGN or offset < end or offset - end >= _ALIGN):
            raise PackDecodeError(f"tensor at offset {offset} does not follow the previous one (ending at {end})")
        end = offset + nbytes if nbytes else end
        tensors.append(PackedTensor(dtype, shape, offset, nbytes))
    if end != total:
        raise PackDecodeError(f"the tensor table covers {end} bytes, the skeleton says {total}")
    return PackSkeleton(bundle["skeleton"], tuple(table), tuple(tensors), total)


def allocate_tensors(skeleton: PackSkeleton, device: torch.device) -> list[torch.Tensor | None]:
    """For each tensor of ``skeleton`` a flat uint8 tensor of its bytes to read it into, each with a storage of
    its own (None for an empty tensor), on ``device``, except 0-dimensional ones, which go to the CPU: torch keeps
    an optimizer's step counters there (unless it is fused or capturable), and one on a GPU would make every step
    read it back; ``load_state_dict`` moves any other scalar where its parameter lives anyway.

    One buffer for the whole stream, which the tensors would view, would stay allocated for as long as any of
    them lives: after a resume the optimizer's state keeps it, model weights' bytes included (``load_state_dict``
    keeps a tensor that is on its parameter's device and dtype as it is), one model's size more than a run that
    never restarted."""
    cpu = torch.device("cpu")
    return [
        torch.empty(t.nbytes, dtype=torch.uint8, device=cpu if t.on_host else device) if t.nbytes else None
        for t in skeleton.tensors
    ]


def rebuild_state(skeleton: PackSkeleton, raw: Sequence[torch.Tensor | None], device: torch.device) -> Any:
    """The state: ``skeleton``'s structure with each tensor reference replaced by ``raw``'s bytes of it (see
    :func:`allocate_tensors`) viewed as the saved dtype and shape (an empty tensor made on ``device``)."""
    tensors: list[torch.Tensor] = []
    for entry, data in zip(skeleton.tensors, raw, strict=True):
        if data is None:
            tensors.append(torch.empty(entry.shape, dtype=entry.dtype, device=device))
        else:
            tensors.append(data.view(entry.dtype).reshape(entry.shape))

    def is_ref(obj: Any) -> bool:
        return type(obj) in (dict, OrderedDict) and len(obj) == 1 and TENSOR_REF_KEY in obj

    def resolve(obj: Any) -> Any:
        if not is_ref(obj):
            return obj
        index = obj[TENSOR_REF_KEY]
        if not isinstance(index, int) or not 0 <= index < len(tensors):
            raise PackDecodeError(f"tensor reference {index!r} is not in the table of {len(tensors)}")
        return tensors[index]

    return map_leaves(skeleton.structure, resolve, is_leaf=is_ref)
