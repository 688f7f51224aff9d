"""The user's own state in the loop's snapshots: any object with ``state_dict`` / ``load_state_dict`` joins
under a name (an EMA model, a ``GradScaler``, a second optimizer, a counter), as torchtitan's ``Stateful``
registry does.

Registered state is part of the training cursor's state (:mod:`elastic.train.cursor`), so it goes wherever the
cursor goes: durable snapshots, node-local ones, the sharded layout's loop entry, and the state a live joiner
receives. It is captured by reference (``state_dict()``'s tensors are copied when the snapshot is staged, as the
model's are) and restored by ``load_state_dict``.

Snapshots are restored when the trainer starts, before a script registers its objects: what a snapshot holds
for a name not registered yet waits, and is loaded when that name is registered. Registration closes at the
first step; a snapshot's state that no object claimed by then is reported, and carried on unchanged in the
next snapshots (nothing is lost).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

__all__ = ["RegistrationError", "StateRegistry", "Stateful", "loop_registry"]

logger = logging.getLogger(__name__)


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> Any: ...


class RegistrationError(ValueError):
    """An object that cannot join the snapshots: no ``state_dict`` / ``load_state_dict``, a name taken, too late."""


class StateRegistry:
    """Named :class:`Stateful` objects: their state for a snapshot, and a snapshot's state loaded into them."""

    def __init__(self) -> None:
        self._objects: dict[str, Stateful] = {}
        self._pending: dict[str, Any] = {}  # restored state for names not registered yet
        self._closed = False

    def register(self, name: str, obj: Any) -> None:
        """Add ``obj`` under ``name``; state a restored snapshot holds for that name is loaded into it now."""
        if not isinstance(name, str) or not name or not name.isprintable():
            raise RegistrationError(f"a state's name must be a non-empty printable string, got {name!r}")
        missing = [m for m in ("state_dict", "load_state_dict") if not callable(getattr(obj, m, None))]
        if missing:
            raise RegistrationError(
                f"register_state({name!r}, ...): a {type(obj).__name__} has no "
                f"{' or '.join(missing)}; wrap it in an object that has both"
            )
        if name in self._objects:
            raise RegistrationError(
                f"register_state({name!r}, ...): the name is registered already (for a "
                f"{type(self._objects[name]).__name__})"
            )
        if self._closed:
            raise RegistrationError(
                f"register_state({name!r}, ...) after the first step: register every object "
                "before training starts, so that a resume restores it"
            )
        self._objects[name] = obj
        if name in self._pending:
            obj.load_state_dict(self._pending.pop(name))
            logger.debug("restored the registered state %r", name)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._objects)

    def state(self) -> dict[str, Any]:
        """Every registered object's ``state_dict()`` by name (references, not copies), and the restored state
        that no object claimed, unchanged."""
        return {**self._pending, **{name: obj.state_dict() for name, obj in self._objects.items()}}

    def load(self, states: Mapping[str, Any]) -> None:
        """Load a snapshot's registered state: into the objects registered, the rest kept until registered."""
        absent = [name for name in self._objects if name not in states]
        if absent:
            logger.warning(
                "the restored state has nothing for %s: %s starts afresh",
                ", ".join(map(repr, absent)),
                "it" if len(absent) == 1 else "they",
            )
        self._pending = {}
        for name, state in states.items():
            obj = self._objects.get(name)
            if obj is None:
                self._pending[name] = state
            else:
                obj.load_state_dict(state)

    def close(self) -> None:
        """Registration ends (the first step): a restored state no object claimed is reported."""
        if self._pending and not self._closed:
            logger.warning(
                "the restored snapshot holds state for %s that no object was registered for: it is not "
                "restored, only carried on into the next snapshots (register_state before the first "
                "step)",
                ", ".join(map(repr, self._pending)),
            )
        self._closed = True


def loop_registry(optimizers: Sequence[Any], state: Mapping[str, Any] | None) -> StateRegistry:
    """The loop's registry at start: the optimizers after the first (``optimizer.1``, ...; the first is the
    snapshot's optimizer entry) and the script's ``state=`` objects, by name."""
    registry = StateRegistry()
    for i, extra in enumerate(optimizers[1:], start=1):
        registry.register(f"optimizer.{i}", extra)
    for name, obj in (state or {}).items():
        registry.register(name, obj)
    return registry
