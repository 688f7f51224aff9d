"""Preemption notices (SIGTERM) turned into one final synchronous save at the next step boundary.

Saving inside the signal handler itself would be wrong: Python runs the handler between two bytecodes of
whatever the main thread is doing, e.g. half-way through ``optimizer.step()``, so the snapshot would mix
old and new parameters.  The handler only records the notice; the training loop checks ``requested``
after each step and calls :meth:`PreemptionWatcher.final_save`, which waits for any background save,
writes the current state synchronously, and flushes the manager.  The scheduler's grace period
(Kubernetes ``terminationGracePeriodSeconds``, Slurm ``--signal``) must cover one step plus one save.

The handler itself runs only when the main thread comes back to Python: not while it is blocked in C code,
e.g. a collective waiting for a peer that vanished without closing its connections. ``on_signal`` tells
another thread at once (through ``signal.set_wakeup_fd``), so that the caller can act on such a hang.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable, Iterable, Mapping
from types import FrameType
from typing import Any

from elastic.checkpoint.api import CheckpointManager

__all__ = ["PreemptionWatcher", "save_on_notice"]

logger = logging.getLogger(__name__)


class PreemptionWatcher:
    """Records the first of ``signals`` received; install from the main thread.

    ``on_signal``, when given, is called once, with the first signal, from a thread of the watcher's own as
    soon as the signal arrives, even while the main thread is blocked in C code; it must return quickly.
    Where the process's wakeup fd is taken already (an asyncio loop), it is called from the handler instead,
    when the main thread next runs Python.
    """

    def __init__(
        self,
        signals: Iterable[signal.Signals] = (signal.SIGTERM,),
        on_signal: Callable[[signal.Signals], None] | None = None,
    ) -> None:
        self._signals = tuple(signals)
        self._on_signal = on_signal
        self._previous: dict[signal.Signals, Any] = {}
        # no lock on the handler's path: a second signal runs the handler inside the first one (torchrun's SIGTERM
        # right after the scheduler's), and a lock taken there would deadlock the main thread
        self._received: signal.Signals | None = None
        self._requested = False
        self._told = False  # on_signal was called (from one place only: the wakeup thread, or the handler)
        self._wakeup_w: int | None = None

    def install(self) -> PreemptionWatcher:
        if self._on_signal is not None:  # first: whether the handler or the thread tells is settled before a signal
            self._watch_wakeup_fd()
        for sig in self._signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
        if self._wakeup_w is not None:
            signal.set_wakeup_fd(-1)
            os.close(self._wakeup_w)  # the reader thread sees end-of-file and ends
            self._wakeup_w = None

    def _watch_wakeup_fd(self) -> None:
        r, w = os.pipe()
        os.set_blocking(w, False)
        previous = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        if previous != -1:  # someone else's (an event loop): leave it, on_signal comes from the handler
            signal.set_wakeup_fd(previous)
            os.close(r)
            os.close(w)
            logger.debug("the signal wakeup fd is in use; on_signal will run when the main thread does")
            return
        self._wakeup_w = w
        wanted = {int(s) for s in self._signals}

        def read() -> None:
            try:
                while data := os.read(r, 64):
                    for signum in data:
                        if signum in wanted:
                            self._record(signal.Signals(signum))
                            self._tell(signal.Signals(signum))
            finally:
                os.close(r)

        threading.Thread(target=read, name="preemption-wakeup", daemon=True).start()

    def _record(self, sig: signal.Signals) -> None:
        if self._received is None:
            self._received = sig
        self._requested = True

    def _tell(self, sig: signal.Signals) -> None:
        if not self._told and self._on_signal is not None:
            self._told = True
            self._on_signal(sig)

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        self._record(signal.Signals(signum))
        if self._wakeup_w is None:  # no wakeup thread (the fd was taken): the handler tells
            self._tell(signal.Signals(signum))

    @property
    def requested(self) -> bool:
        return self._requested

    @property
    def signal_name(self) -> str | None:
        return self._received.name if self._received is not None else None

    def request(self) -> None:
        """Flag a preemption without a signal (e.g. from a scheduler's HTTP notice)."""
        self._requested = True

    def final_save(self, manager: CheckpointManager, step: int, state: Mapping[str, Any] | Any) -> bool:
        """If a preemption was requested: save ``state`` synchronously, close ``manager``, return True.

        For a loop of one's own; :class:`~elastic.train.trainer.ElasticTrainer` makes the same save through
        :func:`save_on_notice` with its own (collective, failure-tolerant) save."""
        if not self.requested:
            return False
        save_on_notice(step, lambda: manager.save(step, state, blocking=True), self.signal_name)
        manager.close()
        return True

    def __enter__(self) -> PreemptionWatcher:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()


def save_on_notice(step: int, save: Callable[[], None], notice: str | None) -> None:
    """The one rule for a preemption notice, whoever runs the loop: ``save`` writes step ``step`` synchronously
    (waiting for any background save first) before the process may leave, so that no step is lost.

    ``notice`` names what asked (a signal's name; None: a request without a signal, or a peer's notice that
    the group agreed on at the step boundary)."""
    logger.warning(
        "preemption notice (%s): writing a final checkpoint at step %d synchronously", notice or "requested", step
    )
    save()
