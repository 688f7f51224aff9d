"""The loop's lines on the console when the script configures no logging.

A tutorial script seldom configures logging, and Python then drops INFO records (and prints WARNING ones bare,
through its last-resort handler): the loop's step lines (``step 12 epoch 0 loss ...``), its resume and its world
of one would never show. So when the trainer joins its group (:func:`elastic.train.collectives.join_process_group`,
:func:`elastic.train.live.join_live_group`, both run by the trainer's constructor) and the root logger has no
handler, :func:`attach` gives the ``elastic`` logger one stream handler (stderr, ``HH:MM:SS rank N LEVEL logger:
message``; the rank is the process group's once it is formed, else torchrun's) and the level INFO, unless the
script gave that logger a level of its own. Once per process: a second trainer attaches nothing.

Propagation stays on, so the loop's records still reach whatever handlers the script sets up later (a file, a
log collector). To never print a line twice, the handler steps aside (drops the record) whenever the root logger
has a handler at the time of the record: a script that calls ``logging.basicConfig(...)`` after constructing the
trainer gets each line once, from its own handler, in its own format. The alternatives were worse:
``propagate = False`` would hide the loop's lines from the script's later handlers, and deciding only once, at
construction, would print every line twice after a later ``basicConfig``. What stays after the script configures
logging is the ``elastic`` logger's level, INFO (set ``logging.getLogger("elastic").setLevel(...)`` to change it).
"""

from __future__ import annotations

import logging
import sys
import threading

import torch.distributed as dist

from elastic.contract.env import TorchrunEnv, WorkerEnvError

__all__ = ["FORMAT", "attach", "console_handler"]

#: the handler's format; ``etrain_rank`` is filled in for each record (:class:`_StepAside`)
FORMAT = "%(asctime)s rank %(etrain_rank)s %(levelname)s %(name)s: %(message)s"
_LOGGER = "elastic"
_lock = threading.Lock()


class _StepAside(logging.Filter):
    """Passes a record (with this process's rank) only while the root logger has no handler of its own."""

    def filter(self, record: logging.LogRecord) -> bool:
        if logging.getLogger().handlers:
            return False  # the script configured logging: its handlers print the record (it propagates there)
        record.etrain_rank = _rank()
        return True


def _rank() -> int | str:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    try:
        return TorchrunEnv.from_environ().rank
    except WorkerEnvError:
        return "?"


class _ConsoleHandler(logging.StreamHandler):
    """The handler :func:`attach` adds (a class of its own, so it is found again and never added twice)."""


def console_handler() -> logging.Handler | None:
    """The handler :func:`attach` added to the ``elastic`` logger, or None."""
    return next((h for h in logging.getLogger(_LOGGER).handlers if isinstance(h, _ConsoleHandler)), None)


def attach() -> bool:
    """See the module docstring: whether a handler was added now (False: the root logger has handlers, or one
    was added before)."""
    with _lock:
        if logging.getLogger().handlers or console_handler() is not None:
            return False
        handler = _ConsoleHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(FORMAT, datefmt="%H:%M:%S"))
        handler.addFilter(_StepAside())
        logger = logging.getLogger(_LOGGER)
        logger.addHandler(handler)
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.INFO)
        return True
