"""The elastic loop's guarantees for a script's own loop with an ``accelerate.Accelerator``: :class:`ElasticAccelerate`.

    accelerator = Accelerator()                                   # no gradient_accumulation_steps: the session's
    model, optimizer = accelerator.prepare(model, optimizer)      # not the DataLoader (see below)
    elastic = ElasticAccelerate(accelerator, model, optimizer, dataset, policy, checkpoint_url="s3://b/run",
                                scheduler=scheduler)               # restores the newest verified snapshot
    loader = DataLoader(dataset, batch_sampler=elastic.batch_sampler, collate_fn=collate, num_workers=2)
    for step in elastic.steps(loader, max_steps=1000):
        for batch in step:                                        # this rank's micro-batches, on its device
            step.backward(model(**batch).loss)                    # accelerator.backward(loss * step.weight)
        optimizer.step(); scheduler.step(); optimizer.zero_grad()

The loop's own-step form (docs/open-loop.md) for a model and optimizer that accelerate prepared: the data is this
rank's share of each step (the loader is *not* passed to ``accelerator.prepare``, whose ``BatchSamplerShard``
would split it again; :class:`Step` moves each batch to the accelerator's device), the micro-batches and their
weights follow the :class:`~elastic.contract.lr.LRPolicy`'s plan for the world (``no_sync`` on all but the last),
the LR factor is applied around ``optimizer.step()``, and snapshots, the restore and the SIGTERM save are the
loop's (:class:`~elastic.integrations.session.BoundarySession`). Restart mode: accelerate owns the process group.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sized
from datetime import timedelta
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import send_to_device

from elastic.contract.lr import LRPolicy
from elastic.integrations.session import BoundarySession, SessionBatchSampler
from elastic.train.config import ElasticConfig, StepInfo

logger = logging.getLogger(__name__)

__all__ = ["ElasticAccelerate", "Step"]


class ElasticAccelerate:
    """See the module docstring. The constructor restores the newest verified snapshot (a collective).

    Args:
        accelerator: the script's ``Accelerator`` (``gradient_accumulation_steps`` 1: the policy sets it).
        model, optimizer: as ``accelerator.prepare`` returned them.
        data: the training data set (map-style; its ``len``).
        policy: the :class:`~elastic.contract.lr.LRPolicy` (its ``base_batch_per_worker`` is the micro-batch), or a
            whole :class:`~elastic.train.config.ElasticConfig`.
        checkpoint_url: where snapshots go (any fsspec URL; default ``$ETRAIN_CHECKPOINT_URL``).
        scheduler: an LR scheduler the script steps; saved and restored.
        state: more objects to save and restore (``state_dict``/``load_state_dict``), by name.
        save_every_steps, save_every_seconds: the snapshot schedule (with a ``policy``).
        on_step: called with each committed step's :class:`~elastic.train.config.StepInfo` on this rank.
    """

    def __init__(
        self,
        accelerator: Accelerator,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        data: Sized,
        policy: LRPolicy | ElasticConfig,
        *,
        checkpoint_url: str | None = None,
        scheduler: Any = None,
        state: dict[str, Any] | None = None,
        save_every_steps: int | None = 50,
        save_every_seconds: timedelta | None = None,
        on_step: Callable[[StepInfo], None] | None = None,
    ) -> None:
        if accelerator.gradient_accumulation_steps != 1:
            raise ValueError(
                "create the Accelerator without gradient_accumulation_steps: the LR policy's step plan "
                "sets the micro-batches of each step for the world"
            )
        config = (
            policy
            if isinstance(policy, ElasticConfig)
            else ElasticConfig(
                policy,
                checkpoint_url=checkpoint_url,
                save_every_steps=save_every_steps,
                save_every_seconds=save_every_seconds,
            )
        )
        self.accelerator = accelerator
        self.model = model
        self.session = BoundarySession(config, len(data), accelerator.device, on_step=on_step)
        for name, obj in (state or {}).items():
            self.session.register_state(name, obj)
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps the torch one
        self.session.attach(accelerator.unwrap_model(model), inner, scheduler)
        self.resumed = self.session.restore()

    @property
    def batch_sampler(self) -> SessionBatchSampler:
        """The ``DataLoader``'s ``batch_sampler``: this rank's micro-batches from the committed cursor."""
        return self.session.batch_sampler

    @property
    def step(self) -> int:
        """Committed steps."""
        return self.session.step

    def steps(
        self, loader: torch.utils.data.DataLoader, *, epochs: int | None = None, max_steps: int | None = None
    ) -> Iterator[Step]:
        """Yield each optimizer step (a :class:`Step`: iterate it for the micro-batches, then step the optimizer);
        a step commits when the next one is asked for. Ends after ``epochs`` (the cursor's) or ``max_steps``
        committed steps, whichever first; the last step is then saved (unless saved) and the snapshots flushed."""
        if loader.batch_sampler is not self.session.batch_sampler:
            raise ValueError(
                "the DataLoader must use batch_sampler=elastic.batch_sampler (and not be prepared by "
                "accelerate, which would shard it again)"
            )
        if epochs is None and max_steps is None:
            raise ValueError("give epochs or max_steps")
        s = self.session
        try:
            while not self._done(epochs, max_steps):
                batches = iter(loader)  # the rest of the cursor's epoch
                while not self._done(epochs, max_steps):
                    step = Step(self, batches, s.plan.accumulation_steps)
                    yield step
                    if not step.complete:
                        raise RuntimeError(f"step {s.step + 1}: iterate all of its micro-batches before the next")
                    if s.commit():
                        break  # the epoch ended
        except BaseException:
            s.close(finished=False)
            raise
        s.finish()

    def _done(self, epochs: int | None, max_steps: int | None) -> bool:
        s = self.session
        return (max_steps is not None and s.step >= max_steps) or (
            epochs is not None and s.cursor.sampler.epoch >= epochs
        )

    def close(self) -> None:
        """Leave early (the snapshots flushed; a finished :meth:`steps` closes by itself)."""
        self.session.close(finished=False)


class Step:
    """One optimizer step of :meth:`ElasticAccelerate.steps`: iterate it for this rank's micro-batches (on the
    accelerator's device; ``no_sync`` on all but the last), ``backward`` each one's mean loss."""

    def __init__(self, owner: ElasticAccelerate, batches: Iterator[Any], accumulation: int) -> None:
        self._owner, self._batches, self.accumulation = owner, batches, accumulation
        self.index = owner.session.step + 1
        self.weight = 0.0
        self.indices: list[int] = []
        self.complete = False

    def __iter__(self) -> Iterator[Any]:
        acc, model = self._owner.accelerator, self._owner.model
        for j in range(self.accumulation):
            batch = next(self._batches)
            micro = self._owner.session.next_micro_batch()
            self.weight = micro.weight
            self.indices.extend(micro.indices)
            last = j == self.accumulation - 1
            with contextlib.nullcontext() if last else acc.no_sync(model):
                yield send_to_device(batch, acc.device)
        self.complete = True

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``accelerator.backward`` of the micro-batch's mean loss times its weight (the exact mean over the step)."""
        self._owner.accelerator.backward(loss * self.weight, **kwargs)
