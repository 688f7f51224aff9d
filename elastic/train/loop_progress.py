"""What the loop tells the outside about its steps: the job service's progress report (rank 0 only, through
:func:`~elastic.train.progress.create_reporter`; a no-op outside the service) and the mean loss in the log every
``progress_every`` steps (a collective)."""

from __future__ import annotations

from datetime import timedelta

from elastic.train.collectives import HostCollectives, log_mean_loss, round_node_names
from elastic.train.config import ElasticConfig
from elastic.train.progress import create_reporter
from elastic.train.snapshots import LoopCheckpoints

__all__ = ["FINAL_REPORT_TIMEOUT", "LoopProgress"]

#: how long a SIGTERM'd worker waits for its last progress report (the one naming the snapshot it saved)
FINAL_REPORT_TIMEOUT = timedelta(seconds=15)


class LoopProgress:
    """See the module docstring. ``rank``: this worker's rank in the (live) group; only rank 0 reports."""

    def __init__(self, config: ElasticConfig, checkpoints: LoopCheckpoints, host: HostCollectives, rank: int) -> None:
        self._config = config
        self._checkpoints = checkpoints
        self._host = host
        self._rank = rank
        self._reporter = create_reporter(rank=rank)

    def started(self, step: int, world_size: int) -> None:
        """The group formed (at start, or re-formed): a report with the round's nodes, sent now."""
        self._reporter.report(
            step, world_size=world_size, total_steps=self._config.total_steps, nodes=round_node_names(), force=True
        )

    def regrouped(self, step: int, rank: int, world_size: int) -> None:
        """A live group re-formed: this worker's rank may have changed (only the group's rank 0 reports)."""
        if (self._rank == 0) != (rank == 0):
            self._reporter.close(timedelta(seconds=1))
            self._reporter = create_reporter(rank=rank)
        self._rank = rank
        self.started(step, world_size)

    def log_loss(self, step: int, epoch: int, lr: float, loss: float | None) -> None:
        """Every ``progress_every`` steps: the step's loss averaged over the workers, in rank 0's log (a
        collective)."""
        every = self._config.progress_every
        if every > 0 and step % every == 0:
            log_mean_loss(step, epoch, loss, lr, self._rank, self._host)

    def publish(self, step: int, world_size: int, epoch: int, lr: float, loss: float | None) -> None:
        """The step for the job service (throttled by the reporter; sent at once when a snapshot committed)."""
        checkpoints = self._checkpoints
        committed = checkpoints.committed_report()
        self._reporter.report(
            step,
            world_size=world_size,
            loss=loss,
            total_steps=self._config.total_steps,
            lr=lr,
            epoch=epoch,
            force=bool(committed),
            **committed,
            **checkpoints.stats.progress_fields(),
            **checkpoints.local_stats.progress_fields(),
        )

    def close_stopped(self, step: int, world_size: int, epoch: int, lr: float, loss: float | None) -> None:
        """SIGTERM'd, the step saved and its snapshots closed: the report naming that snapshot (if the boundary did
        not send it: it was still committing), and a wait for it to be written. It is what the controller shows of
        this stop: it waits longer than the default 5 s (an etcd slow under load took one write past them: the
        status kept the step before, with no snapshot); the signal's sender waits longer still before its SIGKILL
        (torchrun: 30 s)."""
        if self._checkpoints.pending is not None:
            self.publish(step, world_size, epoch, lr, loss)
        self._reporter.close(FINAL_REPORT_TIMEOUT)

    def close_finished(self, step: int, world_size: int, epoch: int, lr: float) -> None:
        """The loop closes, its snapshots closed: the last snapshot's report if not sent yet, and a (bounded) wait for
        the last report to be written."""
        if self._checkpoints.pending is not None:
            self.publish(step, world_size, epoch, lr, None)
        self._reporter.close()
