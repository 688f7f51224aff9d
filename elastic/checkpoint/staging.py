"""Staging: taking a consistent copy of a state's tensors so that training can go on while it is written.

:meth:`Stager.flatten` splits a state into its structure (the skeleton) and its tensors, and copies the
tensors into buffers that are kept and reused from one save to the next.
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from elastic.checkpoint.codec import TENSOR_REF_KEY

__all__ = ["FlatState", "Stager"]


@dataclass
class FlatState:
    """A state split into its structure (``skeleton``) and the tensors it references, in order.

    ``pending`` tensors are still the live sources: ``finish_staging`` (run by the writer thread) copies
    them into staging buffers and then sets ``staged``.
    """

    skeleton: Any
    tensors: list[torch.Tensor] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)
    staged: threading.Event = field(default_factory=threading.Event)
    stager: Stager | None = None

    def finish_staging(self) -> None:
        """Copy the deferred tensors; ``staged`` is set afterwards even if copying fails."""
        try:
            if self.pending and self.stager is not None:
                for index in self.pending:
                    self.tensors[index] = self.stager._copy(index, self.tensors[index])
            self.pending = []
        finally:
            self.staged.set()

    @property
    def tensor_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


def _packable(t: torch.Tensor) -> bool:
    return type(t) in (torch.Tensor, torch.nn.Parameter) and t.layout == torch.strided and not t.is_quantized


class Stager:
    """Splits a state into skeleton + tensors; with ``copy`` the tensors are copied into CPU buffers.

    The buffers are kept and reused by the next ``flatten`` whose tensors have the same shapes and dtypes
    (allocating and faulting in fresh memory costs far more than the copy itself).  A caller must not
    flatten again while a previous result is still being written (the manager keeps one save in flight).
    """

    def __init__(self, reuse_buffers: bool = True) -> None:
        self._reuse = reuse_buffers
        self._buffers: list[torch.Tensor | None] = []

    def flatten(self, state: Any, *, copy: bool, defer: Callable[[torch.Tensor], bool] | None = None) -> FlatState:
        """Split ``state``; with ``copy``, tensors are copied now, except those ``defer`` selects, which
        are left for ``FlatState.finish_staging`` (the caller then must not change them until ``staged``)."""
        flat = FlatState(skeleton=None, stager=self)
        memo: dict[int, int] = {}
        sources: list[torch.Tensor] = []

        def visit(obj: Any) -> Any:
            if isinstance(obj, torch.Tensor) and _packable(obj):
                index = memo.get(id(obj))
                if index is None:
                    index = len(sources)
                    memo[id(obj)] = index
                    sources.append(obj)
                return {TENSOR_REF_KEY: index}
            if type(obj) in (dict, OrderedDict):
                out = type(obj)()
                for key, value in obj.items():
                    out[key] = visit(value)
                return out
            if type(obj) is list:
                return [visit(v) for v in obj]
            if type(obj) is tuple:
                return tuple(visit(v) for v in obj)
            if isinstance(obj, torch.Tensor):
                return obj.detach().to("cpu", copy=True) if copy else obj
            return _copy_leaf(obj) if copy else obj

        flat.skeleton = visit(state)
        if not copy:
            flat.tensors = [_as_cpu(t) for t in sources]
        else:
            del self._buffers[len(sources) :]
            for index, src in enumerate(sources):
                if defer is not None and defer(src):
                    flat.tensors.append(src)
                    flat.pending.append(index)
                else:
                    flat.tensors.append(self._copy(index, src))
        if not flat.pending:
            flat.staged.set()
        return flat

    def _copy(self, index: int, src: torch.Tensor) -> torch.Tensor:
        src = src.detach()
        while len(self._buffers) <= index:
            self._buffers.append(None)
        buf = self._buffers[index] if self._reuse else None
        if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
            buf = torch.empty(src.shape, dtype=src.dtype, device="cpu")
            self._buffers[index] = buf
        buf.copy_(src)
        return buf

    def release(self) -> None:
        self._buffers.clear()


def _copy_leaf(obj: Any) -> Any:
    if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes, torch.dtype, torch.device)):
        return obj
    return copy.deepcopy(obj)


def _as_cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").contiguous().resolve_conj().resolve_neg()
