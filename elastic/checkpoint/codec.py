"""Encoding of replicated state: a small ``skeleton.pt`` plus raw tensor bytes in ``tensors.bin``.

Why not one ``torch.save`` file: ``torch.save`` into a Python stream copies each storage into a Python
``bytes`` object and computes a CRC32 with the GIL held, so a background writer thread would stall the
training thread for most of the write.  Here the structure (dicts, lists, numbers, strings, tensor
references) still goes through ``torch.save``/``torch.load(weights_only=True)``, but tensor data is written
straight from the tensors' memory in large chunks (``os.write`` and ``hashlib`` release the GIL), hashed in
the same pass, and read back with one sequential read into a single buffer that the restored tensors view.

Tensors are restored on CPU, contiguous, with the saved dtype, shape and bytes (bit-identical); tensors
that appear several times in the state (tied weights) are restored as one tensor.  Tensors other than
plain strided ones (sparse, quantized, subclasses) are kept inside the skeleton and go through
``torch.save`` as they are.
"""

from __future__ import annotations

import io
import sys
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from elastic.checkpoint.storage import BinaryWriter

if TYPE_CHECKING:
    from elastic.checkpoint.staging import FlatState

__all__ = [
    "PACK_FORMAT",
    "SKELETON_NAME",
    "TENSORS_NAME",
    "TENSOR_REF_KEY",
    "PackDecodeError",
    "decode_pack",
    "encode_skeleton",
    "tensor_layout",
    "write_tensors",
]

PACK_FORMAT = "elastic-pack/1"
SKELETON_NAME = "skeleton.pt"
TENSORS_NAME = "tensors.bin"
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


def encode_skeleton(flat: FlatState) -> bytes:
    table, total = tensor_layout(flat.tensors)
    bundle = {
        "format": PACK_FORMAT,
        "byteorder": sys.byteorder,
        "tensors": table,
        "tensors_bytes": total,
        "skeleton": flat.skeleton,
    }
    buf = io.BytesIO()
    torch.save(bundle, buf)
    return buf.getvalue()


def _byte_view(t: torch.Tensor) -> memoryview:
    return t.reshape(-1).view(torch.uint8).numpy().data


def write_tensors(
    flat: FlatState,
    out: BinaryWriter,
    update: Callable[[memoryview], None],
    chunk_bytes: int,
    on_chunk: Callable[[], None] | None = None,
) -> int:
    """Write the tensors' bytes in layout order; ``update`` sees every byte written.  Returns the size."""
    written = 0

    def emit(data: memoryview) -> None:
        nonlocal written
        update(data)
        out.write(data)
        written += len(data)
        if on_chunk is not None:
            on_chunk()

    table, total = tensor_layout(flat.tensors)
    for entry, t in zip(table, flat.tensors, strict=True):
        pad = entry["offset"] - written
        if pad:
            emit(memoryview(_ZEROS)[:pad])
        if entry["nbytes"] == 0:
            continue
        view = _byte_view(t)
        for start in range(0, len(view), chunk_bytes):
            emit(view[start : start + chunk_bytes])
    if written != total:
        raise AssertionError(f"tensor pack wrote {written} bytes, layout says {total}")
    return written


def decode_pack(skeleton_bytes: bytes, tensor_buffer: bytearray, *, weights_only: bool = True) -> Any:
    """Rebuild the state from verified bytes; tensors are views into ``tensor_buffer``."""
    try:
        bundle = torch.load(io.BytesIO(skeleton_bytes), map_location="cpu", weights_only=weights_only)
    except Exception as exc:
        hint = " (set CheckpointOptions(weights_only=False) if you trust this storage)" if weights_only else ""
        raise PackDecodeError(f"skeleton does not load{hint}: {' '.join(str(exc).split())[:400]}") from exc
    if not isinstance(bundle, dict) or bundle.get("format") != PACK_FORMAT:
        raise PackDecodeError(f"skeleton is not in format {PACK_FORMAT}")
    if bundle.get("byteorder") != sys.byteorder:
        raise PackDecodeError(f"snapshot was written on a {bundle.get('byteorder')}-endian machine")
    if bundle["tensors_bytes"] != len(tensor_buffer):
        raise PackDecodeError(f"tensors.bin has {len(tensor_buffer)} bytes, skeleton says {bundle['tensors_bytes']}")
    tensors: list[torch.Tensor] = []
    for entry in bundle["tensors"]:
        dtype = getattr(torch, entry["dtype"], None)
        if not isinstance(dtype, torch.dtype):
            raise PackDecodeError(f"unknown dtype {entry['dtype']!r}")
        if entry["nbytes"] == 0:
            tensors.append(torch.empty(entry["shape"], dtype=dtype))
            continue
        raw = torch.frombuffer(tensor_buffer, dtype=torch.uint8, count=entry["nbytes"], offset=entry["offset"])
        tensors.append(raw.view(dtype).reshape(entry["shape"]))

    def rebuild(obj: Any) -> Any:
        if type(obj) in (dict, OrderedDict):
            if len(obj) == 1 and TENSOR_REF_KEY in obj:
                return tensors[obj[TENSOR_REF_KEY]]
            out = type(obj)()
            for key, value in obj.items():
                out[key] = rebuild(value)
            return out
        if type(obj) is list:
            return [rebuild(v) for v in obj]
        if type(obj) is tuple:
            return tuple(rebuild(v) for v in obj)
        return obj

    return rebuild(bundle["skeleton"])
