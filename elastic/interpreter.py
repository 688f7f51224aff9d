"""CPython's cyclic garbage collector in the processes that load torch (torchrun agents, zygotes, workers).

``import torch`` creates a few hundred thousand objects that live as long as the process. The collector
traverses all of them on every full collection: several times while the import runs, and once more when the
interpreter exits. On the 2-core test VM (torch 2.13, CPU build, 2026-11-28) a process that only imports
torch spent 3.7 CPU-s; 2.6 with the exit's collection skipped (``gc.freeze()`` first); 2.3 with the collector
also paused during the import. A zygote's default preload (torch, ``torch._dynamo``, ...): 7.3 -> 5.1 CPU-s.

What this module offers, in the order of a process's life:

- :func:`loading`: around a process's imports. The collector is paused meanwhile; afterwards what was loaded
  is moved to the permanent generation (``gc.freeze()``: no later collection traverses it, and a forked child
  does not touch those pages: the documented recipe for a process that forks without exec), and the exit is
  made cheap as below.
- :func:`freeze_at_exit`: the objects alive when the interpreter starts to exit are frozen, so its final
  collection does not traverse them. What that skips is the freeing of unreachable reference cycles at exit
  (their finalisers do not run); ``atexit`` handlers, ``weakref.finalize`` callbacks, logging's flush and the
  flush of ``sys.stdout``/``sys.stderr`` all still run, and the operating system reclaims the memory. Used
  where the process runs our code or torch's only: torchrun agents (:mod:`elastic.rendezvous.entry`),
  zygotes, our test and benchmark workers; never imposed on a user's training script.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
from collections.abc import Iterator

__all__ = ["freeze_at_exit", "loading"]

_registered = False


def freeze_at_exit() -> None:
    """Freeze every object alive when the interpreter exits, before its final collection (idempotent).

    Registered with :mod:`atexit` on the first call, so it runs after the handlers registered later (they run
    in reverse order) and before the interpreter's own shutdown."""
    global _registered
    if not _registered:
        atexit.register(gc.freeze)
        _registered = True


@contextlib.contextmanager
def loading() -> Iterator[None]:
    """Around imports: the collector paused (as it was before, afterwards), what they loaded frozen, and
    :func:`freeze_at_exit`. A failing import propagates; the collector is restored all the same."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
        gc.freeze()
    finally:
        if enabled:
            gc.enable()
    freeze_at_exit()
