"""The SIGTERM'd worker that cannot reach its step boundary: exit at once instead of hanging until SIGKILL.

A worker that received SIGTERM saves at the next step boundary (:mod:`elastic.train.preemption`). If it is
blocked in a collective with a peer that vanished without closing its connections (a network partition, a
host gone dark), that boundary never comes: :class:`StopTimeout`, armed from the watcher's thread as soon as
the signal arrives, exits the process with 128+signal and no final save after ``stop_timeout`` (at least three
times the slowest of the last steps) without a step boundary, and the group re-forms from the last snapshot,
instead of waiting for torchrun's SIGKILL 30 s later. It counts from the signal or the last boundary after it,
whichever is later: a loop still passing boundaries is not blocked, only not yet at the one where the ranks agree
on the signal (with DDP they agree every few steps, elastic/train/agreement.py).
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from datetime import timedelta

__all__ = ["StopTimeout"]

logger = logging.getLogger(__name__)


class StopTimeout:
    """See the module docstring. ``timeout``: None waits for the boundary however long it takes; ``step``:
    the current step (for the log line)."""

    def __init__(self, timeout: timedelta | None, step: Callable[[], int]) -> None:
        self._timeout = timeout
        self._step = step
        self._step_times: deque[float] = deque(maxlen=50)  # seconds between the last step boundaries
        self._last_boundary: float | None = None
        self._reached = threading.Event()  # the final save began, or the loop is over

    def boundary(self, now: float | None = None) -> None:
        """A step boundary passed (its time joins the last steps')."""
        now = time.monotonic() if now is None else now
        if self._last_boundary is not None:
            self._step_times.append(now - self._last_boundary)
        self._last_boundary = now

    def restart_clock(self) -> None:
        """The group re-formed: the time until the next boundary is no step's."""
        self._last_boundary = None

    def reached(self) -> None:
        """The final save began, or the loop is over: the timeout has nothing left to guard."""
        self._reached.set()

    def arm(self, sig: signal.Signals) -> None:
        """Runs in the watcher's thread as soon as the signal arrives (also while the main thread is blocked)."""
        if self._timeout is None:
            return
        limit = max(self._timeout.total_seconds(), 3 * max(self._step_times, default=0.0))
        armed = time.monotonic()

        def watchdog() -> None:
            while True:
                last = self._last_boundary  # written by the loop's thread (a float: read whole)
                since = max(armed, last if last is not None else armed)
                left = since + limit - time.monotonic()
                if left <= 0:
                    break
                if self._reached.wait(left):
                    return
            logger.error(
                "%s, then %.0f s without a step boundary (step %d's not reached): blocked in a collective with a"
                " vanished peer? exiting without the final save",
                sig.name,
                limit,
                self._step(),
            )
            for handler in logging.getLogger().handlers:
                handler.flush()
            with contextlib.suppress(Exception):  # where each thread was: the hung collective, for the report
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            os._exit(128 + int(sig))

        threading.Thread(target=watchdog, name="stop-timeout", daemon=True).start()
