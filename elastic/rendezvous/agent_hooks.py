"""The one hook by which features start work in a torchrun agent: when its ``etcd-v3`` rendezvous handler is
created, before the first rendezvous.

The rendezvous plugin is the only code of ours that runs inside a stock torchrun agent, so features that
must start there (the prefork zygote, whose imports should overlap the rendezvous) register a callable in
the ``elastic.agent_start`` entry-point group instead of being imported by the plugin. Each receives the
agent's command line and decides for itself whether it applies. A hook that fails is logged and skipped:
it never stops the agent.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points

__all__ = ["GROUP", "run_agent_start_hooks"]

GROUP = "elastic.agent_start"

logger = logging.getLogger(__name__)


def run_agent_start_hooks(argv: Sequence[str]) -> list[str]:
    """Call every registered hook with ``argv``; the names of those that ran without error."""
    ran = []
    for ep in sorted(entry_points(group=GROUP), key=lambda e: e.name):
        try:
            hook: Callable[[Sequence[str]], object] = ep.load()
            hook(argv)
        except Exception:
            logger.warning("agent start hook %s (%s) failed; going on without it", ep.name, ep.value, exc_info=True)
            continue
        ran.append(ep.name)
    return ran
