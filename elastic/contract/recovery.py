"""How a job goes on after a worker failure or a membership change: the one vocabulary of the job spec
(``JobSpec.recovery``), the ``etcd-v3`` rendezvous (``--rdzv-conf recovery=``) and the loop
(``ElasticConfig(recovery=)``). See docs/live-recovery.md."""

from __future__ import annotations

from enum import Enum

__all__ = ["RecoveryMode"]


class RecoveryMode(str, Enum):
    """How a job goes on after a failure: ``restart`` (every worker restarts from the newest snapshot) or
    ``live`` (survivors keep their processes; a new worker joins with a peer's state)."""

    #: torchrun re-forms job-wide rounds: every node's workers are restarted and resume from the newest snapshot
    RESTART = "restart"
    #: the surviving workers keep their processes and re-form their process group in place; a restarted or new
    #: worker joins at a step boundary with the state of a peer
    LIVE = "live"
