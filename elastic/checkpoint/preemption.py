"""Preemption notices (SIGTERM) turned into one final synchronous save at the next step boundary.

Saving inside the signal handler itself would be wrong: Python runs the handler between two bytecodes of
whatever the main thread is doing, e.g. half-way through ``optimizer.step()``, so the snapshot would mix
old and new parameters.  The handler only records the notice; the training loop checks ``requested``
after each step and calls :meth:`PreemptionWatcher.final_save`, which waits for any background save,
writes the current state synchronously, and flushes the manager.  The scheduler's grace period
(Kubernetes ``terminationGracePeriodSeconds``, Slurm ``--signal``) must cover one step plus one save.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterable, Mapping
from types import FrameType
from typing import Any

from elastic.checkpoint.api import CheckpointManager

__all__ = ["PreemptionWatcher"]

logger = logging.getLogger(__name__)


class PreemptionWatcher:
    """Records the first of ``signals`` received; install from the main thread."""

    def __init__(self, signals: Iterable[signal.Signals] = (signal.SIGTERM,)) -> None:
        self._signals = tuple(signals)
        self._previous: dict[signal.Signals, Any] = {}
        self._received: signal.Signals | None = None
        self._event = threading.Event()

    def install(self) -> PreemptionWatcher:
        for sig in self._signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if self._received is None:
            self._received = signal.Signals(signum)
        self._event.set()

    @property
    def requested(self) -> bool:
        return self._event.is_set()

    @property
    def signal_name(self) -> str | None:
        return self._received.name if self._received is not None else None

    def request(self) -> None:
        """Flag a preemption without a signal (e.g. from a scheduler's HTTP notice)."""
        self._event.set()

    def final_save(self, manager: CheckpointManager, step: int, state: Mapping[str, Any] | Any) -> bool:
        """If a preemption was requested: save ``state`` synchronously, close ``manager``, return True."""
        if not self.requested:
            return False
        logger.warning(
            "preemption notice (%s): writing a final checkpoint at step %d",
            self.signal_name or "requested",
            step,
        )
        manager.save(step, state, blocking=True)
        manager.close()
        return True

    def __enter__(self) -> PreemptionWatcher:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()
