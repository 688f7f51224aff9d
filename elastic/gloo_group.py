"""A gloo process group over the default group's ranks, for collectives on CPU tensors that must stay apart from
the default group (an NCCL one, or one whose collectives a background thread must not interleave with).

:class:`GlooGroupBeside` makes it on first use and again whenever the default group is replaced (live recovery
forms a new default group per generation).  Making it is a collective: every rank of the default group must ask
for it at the same point.  The sharded checkpointer and the training loop's host-side agreements each hold one.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist

__all__ = ["GlooGroupBeside"]


class GlooGroupBeside:
    """See the module docstring.  ``purpose`` names the group in the error raised when it cannot form;
    ``timeout``: its collectives' (None: torch's default)."""

    def __init__(self, purpose: str, timeout: timedelta | None = None) -> None:
        self._purpose = purpose
        self._timeout = timeout
        self._group: Any = None
        self._world: Any = None  # the default group that ``_group`` was made beside
        self.made = 0  # groups made so far (one per default group)

    def get(self) -> Any:
        """The group beside the current default group (made now if that group is new to it)."""
        world = dist.group.WORLD
        if self._group is None or self._world is not world:
            try:
                group = dist.new_group(backend="gloo", timeout=self._timeout)  # None: torch's default
            except RuntimeError as exc:
                raise RuntimeError(
                    f"the gloo group for {self._purpose} (beside the {dist.get_backend()} group) could not be "
                    f"formed: {exc}. gloo needs this host's name to resolve to an address the other ranks reach, "
                    "or GLOO_SOCKET_IFNAME naming the interface to use"
                ) from exc
            self._group, self._world = group, world
            self.made += 1
        return self._group
