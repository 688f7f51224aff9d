"""Which prefork zygote a warm job's torchrun and workers fork from on this node (:mod:`elastic.prefork`).

A warm job (``warm_start``, the default) no longer pays a Python start and a torch import for its torchrun at each
generation: its torchrun runs as a prefork client (:attr:`elastic.torchrun_cli.TorchrunCommand.forked`) whose
child, forked from a zygote with torch imported, runs stock torchrun; the workers fork from the same zygote. Which
zygote, decided here:

- on a hot spare, the agent's own, started at registration and kept warm between jobs;
- where the agent's environment names an owner already (``ETRAIN_PREFORK_OWNER``: an operator's, or a test
  process's shared zygote), that one;
- else one per job (``ETRAIN_PREFORK_KEY`` = the job's id), owned by the agent: the job's first torchrun client
  starts it, with the job's interpreter and environment; each later generation on this node forks from it; it is
  stopped once the job has left the node (:meth:`JobZygotes.forget`). If the agent dies, the zygote lets the
  job's processes end for the agent's stop grace (``ETRAIN_PREFORK_GRACE``: the torchrun, told by its parent-death
  SIGTERM, stops its workers as the agent would have), then kills what is left.

A job that runs as a uid of its own (:mod:`service.agent.isolation`), or under a launcher of its own (containers),
starts cold: the agent's zygotes run as the agent's uid, on the agent's host.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from datetime import timedelta

from elastic import prefork
from elastic.contract import env as contract
from elastic.prefork.common import ZygoteKeyError, check_key

logger = logging.getLogger(__name__)


#: how long :meth:`JobZygotes.close` waits for each zygote to exit (one exits within milliseconds of its SIGTERM)
CLOSE_WAIT = timedelta(seconds=5)


class JobZygotes:
    """The zygotes this agent (this process) owns for its warm jobs, one per job."""

    def __init__(self, *, spare: bool, stop_grace: timedelta, inherited_owner: str | None = None) -> None:
        self.spare = spare
        self.stop_grace = stop_grace
        # an owner named in the agent's own environment: every warm job of this agent forks from its zygote
        self.inherited_owner = (
            inherited_owner if inherited_owner is not None else os.environ.get(contract.PREFORK_OWNER) or None
        )
        self._started: set[str] = set()  # jobs given a zygote of their own (stopped by forget / close)

    def env_for(self, job_id: str, *, warm: bool, own_uid: bool, own_launcher: bool) -> dict[str, str]:
        """The variables that send job ``job_id``'s torchrun and workers to their zygote; empty: a cold start
        (torchrun as a fresh interpreter; with ``warm``, its workers from a zygote of that torchrun's)."""
        if not warm or own_uid or own_launcher:
            return {}
        if self.spare:
            return {contract.PREFORK_OWNER: str(os.getpid())}
        if self.inherited_owner is not None:
            return {contract.PREFORK_OWNER: self.inherited_owner}
        try:
            key = check_key(job_id)
        except ZygoteKeyError:
            logger.warning("job id %r cannot name a zygote: its torchrun starts cold", job_id)
            return {}
        assert key is not None
        self._started.add(key)
        return {
            contract.PREFORK_OWNER: str(os.getpid()),
            contract.PREFORK_KEY: key,
            contract.PREFORK_GRACE: f"{self.stop_grace.total_seconds():g}",
        }

    def forget(self, keep: Iterable[str], wait: timedelta = timedelta(0)) -> list[str]:
        """Stop the zygotes of the jobs not in ``keep`` (assigned here, or still running or stopping), waiting up
        to ``wait`` for each to exit; returns the ids of the jobs forgotten (a zygote that had already exited is
        not an error)."""
        gone = sorted(self._started - set(keep))
        for job_id in gone:
            self._started.discard(job_id)
            if prefork.stop_zygote(os.getpid(), job_id, wait=wait.total_seconds()):
                logger.info("job %s left this node: its zygote stopped", job_id)
        return gone

    def close(self) -> None:
        """Stop every zygote of this agent's jobs (their torchruns have been stopped) and wait, a few seconds at
        most, for them to exit: a job that comes back to an agent started again finds none of them."""
        self.forget((), wait=CLOSE_WAIT)
