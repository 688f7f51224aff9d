"""The node-local tiers' per-snapshot lines at DEBUG.

The node-local tiers (:mod:`elastic.checkpoint.tiers`, :mod:`elastic.train.shard_tier`) take a snapshot every step
or every few, through the same checkpoint managers as durable snapshots, which log each commit (``checkpoint step N
committed at <slot>``), each retention (``checkpoint retention removed step(s) N under <slot>``) and their start-up
probe at INFO: right for a durable snapshot every few minutes, a line every 2-3 steps for the node-local ones. A
tier registers its storage's URL here (:func:`quiet`, until :func:`unquiet`); every INFO record that the loggers
in :data:`LOGGERS` log with that URL among its arguments is then a DEBUG record: its level is lowered in place,
and it goes on to the handlers only if its logger is enabled for DEBUG. Warnings and errors are left as they are,
and so are the tiers' own lines (a resume from a node-local snapshot stays INFO).

A filter, not a level per manager: the managers take no log level of their own (their module is being rewritten
as this is written; a ``CheckpointOptions`` field for the level of a manager's routine lines would replace this
module). The loggers' names are the managers' and the writer's, which their modules keep.
"""

from __future__ import annotations

import logging
import threading

__all__ = ["LOGGERS", "quiet", "quieted", "unquiet"]

#: where the managers log their commits, probes and retentions
LOGGERS = ("elastic.checkpoint.manager", "elastic.checkpoint.writer")

_lock = threading.Lock()
_urls: frozenset[str] = frozenset()  # replaced whole, never changed in place: read without the lock
_installed = False


class _Demote(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.INFO or not isinstance(record.args, tuple):
            return True
        if not any(isinstance(arg, str) and arg in _urls for arg in record.args):
            return True
        record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


def quiet(url: str) -> None:
    """Log the managers' INFO lines about the storage at ``url`` at DEBUG (see the module docstring)."""
    global _urls, _installed
    with _lock:
        if not _installed:
            for name in LOGGERS:
                logging.getLogger(name).addFilter(_Demote())
            _installed = True
        _urls = _urls | {url}


def unquiet(url: str) -> None:
    """Undo :func:`quiet` for ``url`` (nothing if it was not quieted)."""
    global _urls
    with _lock:
        _urls = _urls - {url}


def quieted() -> frozenset[str]:
    """The URLs whose lines are at DEBUG now."""
    return _urls
