"""Helpers shared by the rendezvous handler suites: a rendezvous in a thread, and waiting for a condition."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousHandler

__all__ = ["Joiner", "until"]


class Joiner:
    """``next_rendezvous`` in a thread; ``result()`` returns the RendezvousInfo or raises its error;
    ``out["done"]`` is when it returned (monotonic)."""

    def __init__(self, handler: RendezvousHandler) -> None:
        self.out: dict[str, Any] = {}
        self.thread = threading.Thread(target=self._run, args=(handler,), daemon=True)
        self.thread.start()

    def _run(self, handler: RendezvousHandler) -> None:
        try:
            self.out["info"] = handler.next_rendezvous()
        except Exception as exc:
            self.out["error"] = exc
        self.out["done"] = time.monotonic()

    def result(self, timeout: float = 60) -> Any:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "next_rendezvous did not return"
        if "error" in self.out:
            raise self.out["error"]
        return self.out["info"]


def until(predicate: Callable[[], bool], timeout: float, what: str) -> float:
    """Wait for ``predicate``; how long it took. Fails naming ``what`` after ``timeout`` seconds."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, f"{what} did not happen within {timeout}s"
        time.sleep(0.05)
    return time.monotonic() - start
