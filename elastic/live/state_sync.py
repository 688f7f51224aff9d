"""Copy training state from one member of a process group to all others (a joiner's start, no storage read).

:func:`broadcast_state` sends any nesting of dicts, lists and tuples of tensors and plain values: first its
skeleton (the structure, with each tensor replaced by its shape, dtype and device kind) as one pickled
object, then every tensor with ``dist.broadcast`` on the receiver's device (NCCL on a GPU: the bulk of the
state never passes through host memory). Receivers build tensors of the same shapes, so state that a
receiver does not have yet (a joiner's empty optimizer state) arrives whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from elastic.checkpoint.tree import iter_leaves, map_leaves

__all__ = ["broadcast_state"]


@dataclass(frozen=True)
class _TensorSlot:
    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    on_device: bool  # the source's tensor was on an accelerator: the receiver's copy goes to its device


def _skeleton(obj: Any, tensors: list[torch.Tensor]) -> Any:
    def slot(o: Any) -> Any:
        if not isinstance(o, torch.Tensor):
            return o
        tensors.append(o)
        return _TensorSlot(len(tensors) - 1, tuple(o.shape), o.dtype, o.device.type != "cpu")

    return map_leaves(obj, slot)


def _fill(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    return map_leaves(skeleton, lambda o: tensors[o.index] if isinstance(o, _TensorSlot) else o)


def _slots(skeleton: Any) -> list[_TensorSlot]:
    return [o for o in iter_leaves(skeleton) if isinstance(o, _TensorSlot)]


def broadcast_state(state: Any, src: int, device: torch.device, group: dist.ProcessGroup | None = None) -> Any:
    """``state`` from rank ``src`` on every rank of ``group`` (default: the world; ``src`` is a global rank;
    a collective; on ``src`` its own ``state`` is returned).

    ``device``: where this rank keeps tensors that lived on an accelerator at the source (the process
    group's device); tensors the source held on the CPU stay on the CPU (gloo sends them as they are,
    NCCL through ``device``)."""
    rank = dist.get_rank()
    tensors: list[torch.Tensor] = []
    skeleton = _skeleton(state, tensors) if rank == src else None
    box = [skeleton]
    dist.broadcast_object_list(box, src=src, group=group, device=device if device.type != "cpu" else None)
    skeleton = box[0]
    slots = sorted(_slots(skeleton), key=lambda s: s.index)
    nccl = dist.get_backend(group) == "nccl"
    received: list[torch.Tensor] = []
    for slot in slots:
        if rank == src:
            t = tensors[slot.index]
            wire = t if (not nccl or t.device.type != "cpu") else t.to(device)
            dist.broadcast(wire.contiguous(), src, group=group)
            received.append(t)
        else:
            home = device if slot.on_device else torch.device("cpu")
            wire_device = device if nccl else home
            t = torch.empty(slot.shape, dtype=slot.dtype, device=wire_device)
            dist.broadcast(t, src, group=group)
            received.append(t if t.device == home else t.to(home))
    return state if rank == src else _fill(skeleton, received)
