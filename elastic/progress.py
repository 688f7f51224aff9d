"""Training progress reported by a job's workers to one etcd key that the job service reads.

The service's node agent sets the progress key and the etcd connection in each worker's environment
(:class:`elastic.env.WorkerEnv`); :func:`create_reporter` builds a reporter from them. Outside the service
(plain torchrun, tests) the variables are absent and the reporter does nothing, so training code can
always call it.

Only rank 0 writes (one key per job, last value wins). Reports are throttled to one per
``min_interval`` unless forced (a committed checkpoint, the last step). A failed write is logged and
dropped: progress reporting never stops training.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from datetime import timedelta
from typing import Any

from elastic.env import WorkerEnv
from elastic.etcd import EtcdClient, EtcdError, create_client

logger = logging.getLogger(__name__)

__all__ = [
    "EtcdProgressReporter",
    "NullProgressReporter",
    "Progress",
    "ProgressReporter",
    "create_reporter",
]


@dataclass(frozen=True)
class Progress:
    """One progress report (JSON in etcd). ``checkpoint_*`` describe the latest *committed* checkpoint."""

    step: int
    world_size: int
    time: float
    total_steps: int | None = None
    loss: float | None = None
    generation: int | None = None
    restart_count: int = 0
    checkpoint_step: int | None = None
    checkpoint_path: str | None = None
    #: the service's names of the nodes the workers of this round run on (sorted), when known
    nodes: list[str] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Progress:
        data = json.loads(raw)
        if not isinstance(data, dict):
            raise ValueError("a progress report must be a JSON object")
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})


class ProgressReporter:
    """Publishes progress for the service. Contract: ``report`` never raises and never blocks training
    for longer than one etcd request; ``close`` releases connections and may be called twice."""

    def report(
        self,
        step: int,
        *,
        world_size: int,
        loss: float | None = None,
        total_steps: int | None = None,
        checkpoint_step: int | None = None,
        checkpoint_path: str | None = None,
        nodes: list[str] | None = None,
        force: bool = False,
        **extra: Any,
    ) -> None:
        """``nodes``: the round's node names; remembered, like the checkpoint, for later reports."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class NullProgressReporter(ProgressReporter):
    """Used outside the service: drops every report."""

    def report(self, step: int, *, world_size: int, **kwargs: Any) -> None:
        return None

    def close(self) -> None:
        return None


class EtcdProgressReporter(ProgressReporter):
    """Writes :class:`Progress` JSON to ``key``; remembers the last committed checkpoint across reports."""

    def __init__(
        self,
        client: EtcdClient,
        key: str,
        min_interval: timedelta = timedelta(seconds=1),
        generation: int | None = None,
        restart_count: int = 0,
    ) -> None:
        self._client = client
        self._key = key
        self._min_interval = min_interval.total_seconds()
        self._generation = generation
        self._restart_count = restart_count
        self._last_sent = 0.0
        self._checkpoint: tuple[int | None, str | None] = (None, None)
        self._nodes: list[str] | None = None

    def report(
        self,
        step: int,
        *,
        world_size: int,
        loss: float | None = None,
        total_steps: int | None = None,
        checkpoint_step: int | None = None,
        checkpoint_path: str | None = None,
        nodes: list[str] | None = None,
        force: bool = False,
        **extra: Any,
    ) -> None:
        if nodes is not None:
            self._nodes = sorted(nodes)
        if checkpoint_step is not None:
            self._checkpoint = (checkpoint_step, checkpoint_path)
            force = True
        now = time.time()
        if not force and now - self._last_sent < self._min_interval:
            return
        progress = Progress(
            step=step,
            world_size=world_size,
            time=now,
            total_steps=total_steps,
            loss=loss,
            generation=self._generation,
            restart_count=self._restart_count,
            checkpoint_step=self._checkpoint[0],
            checkpoint_path=self._checkpoint[1],
            nodes=self._nodes,
            extra=extra,
        )
        try:
            self._client.put(self._key, progress.to_json())
            self._last_sent = now
        except EtcdError as exc:
            logger.warning("progress report dropped: %s", exc)

    def close(self) -> None:
        self._client.close()


def create_reporter(
    env: Mapping[str, str] | None = None, min_interval: timedelta = timedelta(seconds=1)
) -> ProgressReporter:
    """A reporter for this worker: writes only on rank 0 and only when the service configured a key."""
    env = os.environ if env is None else env
    worker = WorkerEnv.from_environ(env)
    if worker.job is None or worker.etcd is None or int(env.get("RANK", "0")) != 0:
        return NullProgressReporter()
    # short timeouts: a report waits for etcd at most this long, never blocking training for longer
    etcd = replace(worker.etcd, op_timeout=timedelta(seconds=5), request_timeout=timedelta(seconds=2))
    return EtcdProgressReporter(
        create_client(etcd.config()),
        worker.job.progress_key,
        min_interval=min_interval,
        generation=worker.job.generation,
        restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
    )
