"""The ``torchrun.handlers`` entry point of the ``etcd-v3`` backend.

torch loads the group's entry points while ``torch.distributed.elastic.rendezvous`` itself is being
imported. This module therefore imports nothing from torch: pointing the entry point at
:mod:`elastic.rendezvous.plugin` (which imports torch's rendezvous package) made ``import
elastic.rendezvous.plugin`` load the entry point while the plugin module was half initialised, and torch
logged a traceback and left ``etcd-v3`` unregistered in that process.
"""

from __future__ import annotations

from typing import Any

__all__ = ["create_handler", "plugin"]


def create_handler(params: Any) -> Any:
    """Build the ``etcd-v3`` handler (:func:`elastic.rendezvous.plugin.create_handler`).

    This runs in a torchrun agent, a process of torch's code and ours only: its exit skips the collector's
    last pass over the objects torch loaded (:func:`elastic.interpreter.freeze_at_exit`, ~1 CPU-s per agent)."""
    from elastic.interpreter import freeze_at_exit
    from elastic.rendezvous.plugin import create_handler as create

    freeze_at_exit()
    return create(params)


def plugin() -> Any:
    """Entry point of the ``torchrun.handlers`` group: torch calls it and registers what it returns."""
    return create_handler
