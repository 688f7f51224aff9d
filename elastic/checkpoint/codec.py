"""Encoding of replicated state: a small ``skeleton.pt`` plus the raw tensor bytes in segment files.

Why not one ``torch.save`` file: ``torch.save`` into a Python stream copies each storage into a Python
``bytes`` object and computes a CRC32 with the GIL held, so a background writer thread would stall the
training thread for most of the write.  Here the structure (dicts, lists, numbers, strings, tensor
references) still goes through ``torch.save``/``torch.load(weights_only=True)``, but tensor data is written
straight from the tensors' memory in large chunks (``os.write`` and ``hashlib`` release the GIL) as one
64-byte aligned byte stream, cut into segment files (see :mod:`elastic.checkpoint.segments`), and read back
into a single buffer that the restored tensors view.

Tensors are restored with the saved dtype, shape and bytes (bit-identical), contiguous, on the device of
that buffer (CPU unless the loader reads into a device); tensors that appear several times in the state
(tied weights) are restored as one tensor.  Tensors other than plain strided ones (sparse, quantized,
subclasses) are kept inside the skeleton and go through ``torch.save`` as they are (restored on CPU).
"""

from __future__ import annotations

import io
import sys
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
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
    "decode_pack",
    "encode_skeleton",
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


def _slice(buffer: torch.Tensor, host: Any, offset: int, nbytes: int) -> torch.Tensor:
    """Bytes ``[offset, offset + nbytes)`` of ``buffer``.  On CPU a tensor with a storage of its own over that
    memory (``host`` is ``buffer``'s numpy view): torch functions such as ``torch.set_rng_state`` ignore a
    storage offset, and ``torch.save`` of one restored tensor must not write the whole buffer.  On other
    devices a view (there is no ``frombuffer`` for device memory)."""
    if host is None:
        return buffer[offset : offset + nbytes]
    return torch.frombuffer(host, dtype=torch.uint8, count=nbytes, offset=offset)


def _scalars_to_cpu(tensors: list[torch.Tensor]) -> None:
    """Put the 0-dimensional tensors of a state loaded into a device back on CPU, with one copy: torch keeps an
    optimizer's step counters there (unless it is fused or capturable), and one on a GPU would make every
    step read it back; ``load_state_dict`` moves any other scalar where its parameter lives anyway."""
    scalars = [i for i, t in enumerate(tensors) if t.dim() == 0]
    if not scalars:
        return
    raw = [tensors[i].reshape(1).view(torch.uint8) for i in scalars]
    host = torch.cat(raw).cpu()
    at = 0
    for i, r in zip(scalars, raw, strict=True):
        tensors[i] = host[at : at + r.numel()].clone().view(tensors[i].dtype).reshape(())
        at += r.numel()


def decode_pack(skeleton_bytes: bytes, tensor_buffer: torch.Tensor, *, weights_only: bool = True) -> Any:
    """Rebuild the state from verified bytes; tensors are views into ``tensor_buffer`` (the tensor stream as
    a 1-D uint8 tensor, on any device), so they live on its device, except 0-dimensional ones (see
    :func:`_scalars_to_cpu`)."""
    try:
        bundle = torch.load(io.BytesIO(skeleton_bytes), map_location="cpu", weights_only=weights_only)
    except Exception as exc:
        hint = " (set CheckpointOptions(weights_only=False) if you trust this storage)" if weights_only else ""
        raise PackDecodeError(f"skeleton does not load{hint}: {' '.join(str(exc).split())[:400]}") from exc
    if not isinstance(bundle, dict) or bundle.get("format") != PACK_FORMAT:
        raise PackDecodeError(f"skeleton is not in format {PACK_FORMAT}")
    if bundle.get("byteorder") != sys.byteorder:
        raise PackDecodeError(f"snapshot was written on a {bundle.get('byteorder')}-endian machine")
    if bundle["tensors_bytes"] != tensor_buffer.numel():
        raise PackDecodeError(f"tensor data has {tensor_buffer.numel()} bytes, skeleton says {bundle['tensors_bytes']}")
    host = tensor_buffer.numpy() if tensor_buffer.device.type == "cpu" and tensor_buffer.numel() else None
    tensors: list[torch.Tensor] = []
    for entry in bundle["tensors"]:
        dtype = getattr(torch, entry["dtype"], None)
        if not isinstance(dtype, torch.dtype):
            raise PackDecodeError(f"unknown dtype {entry['dtype']!r}")
        if entry["nbytes"] == 0:
            tensors.append(torch.empty(entry["shape"], dtype=dtype, device=tensor_buffer.device))
            continue
        if entry["offset"] % _ALIGN or entry["offset"] + entry["nbytes"] > tensor_buffer.numel():
            raise PackDecodeError(f"tensor at offset {entry['offset']} ({entry['nbytes']} bytes) is outside the data")
        raw = _slice(tensor_buffer, host, entry["offset"], entry["nbytes"])
        tensors.append(raw.view(dtype).reshape(entry["shape"]))
    if host is None:
        _scalars_to_cpu(tensors)

    def is_ref(obj: Any) -> bool:
        return type(obj) in (dict, OrderedDict) and len(obj) == 1 and TENSOR_REF_KEY in obj

    return map_leaves(bundle["skeleton"], lambda o: tensors[o[TENSOR_REF_KEY]] if is_ref(o) else o, is_leaf=is_ref)
