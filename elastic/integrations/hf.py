"""The elastic loop's guarantees inside Hugging Face ``transformers.Trainer``: one line, :func:`make_elastic`.

    trainer = Trainer(model=model, args=args, train_dataset=train, data_collator=collator)
    trainer = make_elastic(trainer, checkpoint_url="s3://bucket/run1", base_world_size=8)   # the one line
    trainer.train()

What it gives (see docs/integrations.md): the elastic sampler (every sample once per epoch across resizes and
restarts), the global batch kept with the gradient accumulation set for the world (or the LR rescaled, by the
:class:`~elastic.contract.lr.LRPolicy`), verified snapshots through our checkpoint manager to any fsspec URL,
resume from the newest verified snapshot with no ``resume_from_checkpoint``, and a save at the step boundary on
SIGTERM. The work is the loop's own pieces (:class:`~elastic.integrations.session.BoundarySession`) driven from
the ``Trainer``'s step boundary.

How: :func:`make_elastic` takes a constructed ``Trainer`` (any subclass: TRL's ``SFTTrainer``, your own) and
returns it with its class swapped for a subclass of it that overrides three methods, plus a callback:

- ``get_train_dataloader``: a ``DataLoader`` over the session's
  :class:`~elastic.integrations.session.SessionBatchSampler` (this rank's share already: it is not passed through
  ``accelerator.prepare``, so accelerate's ``BatchSamplerShard`` never splits it again; the Trainer moves each
  batch to its device itself), with the Trainer's collator (unused columns removed as the Trainer does), workers,
  pinned memory and ``worker_init_fn``;
- ``training_step`` / ``compute_loss``: each micro-batch's loss is weighted as in the loop (the exact mean over the
  step's samples whatever the split; ``x 1.0`` when the split is even, i.e. nothing); the Trainer's
  ``num_items_in_batch`` token count is turned off, the weight is per sample, as in the loop;
- ``train``: ``resume_from_checkpoint`` is ignored (with a warning): the newest verified snapshot is the resume
  point;
- the callback, at ``on_train_begin``: gates the optimizer's ``step`` with the LR factor and restores the newest
  snapshot (model, optimizer, scheduler, data cursor, RNG, the Trainer's ``TrainerState``); at ``on_step_end``:
  commits the step (cursor), takes the scheduled snapshots and, after a SIGTERM, saves and exits 143; at
  ``on_train_end``: saves the last step (unless saved) and flushes.
"""

from __future__ import annotations

import logging
import sys
import warnings
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from typing import Any

import torch
from torch.utils.data import DataLoader
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import seed_worker

from elastic.contract.lr import LRPolicy, LRRule
from elastic.integrations.session import BoundarySession
from elastic.train.config import ElasticConfig, StepInfo

logger = logging.getLogger(__name__)

__all__ = ["ElasticCallback", "make_elastic"]

#: the ``TrainerState`` fields a snapshot carries (the rest are the run's settings, recomputed by each start)
_STATE_FIELDS = (
    "global_step",
    "epoch",
    "log_history",
    "total_flos",
    "num_input_tokens_seen",
    "best_metric",
    "best_global_step",
    "best_model_checkpoint",
    "trial_name",
    "trial_params",
)


def make_elastic(
    trainer: Trainer,
    *,
    checkpoint_url: str | None = None,
    base_world_size: int | None = None,
    policy: LRPolicy | None = None,
    config: ElasticConfig | None = None,
    save_every_steps: int | None = 50,
    save_every_seconds: timedelta | None = None,
    on_step: Callable[[StepInfo], None] | None = None,
) -> Trainer:
    """Make ``trainer`` elastic (in place; returned for the one-line form). Call it after the ``Trainer`` is built,
    before ``train()``.

    Args:
        trainer: a ``transformers.Trainer`` (or a subclass), built with its ``train_dataset`` (map-style).
        checkpoint_url: where snapshots go (any fsspec URL; default ``$ETRAIN_CHECKPOINT_URL``).
        base_world_size: the world the arguments' batch and LR are meant for. With no ``policy``, the policy is
            ``fixed-global-batch`` from the arguments: ``learning_rate``, ``per_device_train_batch_size`` and
            ``gradient_accumulation_steps`` at ``base_world_size`` workers (the global batch of that world is
            kept; a smaller world runs more micro-batches).
        policy: an :class:`~elastic.contract.lr.LRPolicy` of your own (``linear``/``sqrt``: the LR is rescaled and
            the accumulation stays); its ``base_batch_per_worker`` is the micro-batch.
        config: the loop's :class:`~elastic.train.config.ElasticConfig` (everything above in one object).
        save_every_steps, save_every_seconds: the snapshot schedule (when no ``config``).
        on_step: called with each committed step's :class:`~elastic.train.config.StepInfo` on this rank.
    """
    args = trainer.args
    if config is None:
        if policy is None:
            if base_world_size is None:
                raise ValueError(
                    "make_elastic needs base_world_size (the world the arguments' batch and LR are "
                    "meant for) or a policy"
                )
            policy = LRPolicy(
                LRRule.FIXED_GLOBAL_BATCH,
                args.learning_rate,
                base_world_size,
                args.per_device_train_batch_size,
                accumulation_steps=args.gradient_accumulation_steps,
            )
        seed = args.data_seed if args.data_seed is not None else args.seed
        config = ElasticConfig(
            policy,
            checkpoint_url=checkpoint_url,
            save_every_steps=save_every_steps,
            save_every_seconds=save_every_seconds,
            seed=seed,
        )
    elif policy is not None or checkpoint_url is not None:
        raise ValueError("give config, or policy/checkpoint_url, not both")
    dataset = trainer.train_dataset
    if dataset is None or isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
        raise ValueError(
            "make_elastic needs a map-style train_dataset (with __len__): the elastic sampler chooses "
            "each step's samples by index"
        )
    if getattr(trainer, "is_fsdp_enabled", False) or getattr(trainer, "is_deepspeed_enabled", False):
        raise ValueError(
            "make_elastic supports replicated (DDP) training: FSDP and DeepSpeed shard the state, "
            "which its snapshots do not (the loop's own ElasticTrainer(parallelize=) does)"
        )
    if not getattr(args, "dataloader_in_order", True):
        raise ValueError("dataloader_in_order=False: the loader must serve the micro-batches in the sampler's order")
    if trainer.compute_loss_func is not None:
        warnings.warn(
            "make_elastic: compute_loss_func normalises the loss itself; the loop's per-sample weights of "
            "uneven micro-batches are not applied to it",
            stacklevel=2,
        )
    session = BoundarySession(config, len(dataset), args.device, on_step=on_step)
    plan = session.plan
    # the step plan for this world: the Trainer reads both each time it needs them
    args.per_device_train_batch_size = plan.micro_batch
    args.gradient_accumulation_steps = plan.accumulation_steps
    trainer._train_batch_size = plan.micro_batch
    trainer.model_accepts_loss_kwargs = False  # the loop's per-sample weights, not num_items_in_batch
    logger.info(
        "elastic: world %d, global batch %d = %d x %d micro-batches of %d per rank; LR factor %.4g",
        session.world_size,
        plan.global_batch,
        session.world_size,
        plan.accumulation_steps,
        plan.micro_batch,
        session.lr_factor,
    )
    trainer.__class__ = _elastic_class(type(trainer))
    trainer._elastic = session  # type: ignore[attr-defined]
    trainer._elastic_factor = None  # type: ignore[attr-defined]
    session.register_state("hf_trainer_state", _TrainerStateHolder(trainer))
    trainer.add_callback(ElasticCallback(trainer, session))
    return trainer


class _ElasticTrainer(Trainer):
    """The overrides :func:`make_elastic` puts in front of the ``Trainer``'s class (see the module docstring)."""

    _elastic: BoundarySession
    _elastic_factor: float | None

    def get_train_dataloader(self) -> DataLoader:
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        dataset = self.train_dataset
        collator = self.data_collator
        datasets = sys.modules.get("datasets")  # a datasets.Dataset given: the library is imported already
        if datasets is not None and isinstance(dataset, datasets.Dataset):
            dataset = self._remove_unused_columns(dataset, description="training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="training")
        args = self.args
        workers = args.dataloader_num_workers
        generator = torch.Generator().manual_seed(self._elastic.config.seed)  # never draws from the global RNG
        return DataLoader(
            dataset,
            batch_sampler=self._elastic.batch_sampler,
            collate_fn=collator,
            num_workers=workers,
            pin_memory=args.dataloader_pin_memory,
            persistent_workers=args.dataloader_persistent_workers and workers > 0,
            prefetch_factor=args.dataloader_prefetch_factor if workers > 0 else None,
            multiprocessing_context=args.dataloader_multiprocessing_context if workers > 0 else None,
            worker_init_fn=partial(seed_worker, num_workers=workers, rank=args.process_index),
            generator=generator,
        )

    def training_step(
        self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: torch.Tensor | int | None = None
    ) -> torch.Tensor:
        micro = self._elastic.next_micro_batch()
        # the Trainer divides a micro-batch's mean loss by its accumulation steps: the loop's weight in its place
        self._elastic_factor = micro.weight * self.current_gradient_accumulation_steps
        try:
            return super().training_step(model, inputs, num_items_in_batch)
        finally:
            self._elastic_factor = None

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> Any:
        out = super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        factor = self._elastic_factor
        if factor is None or factor == 1.0:
            return out
        if isinstance(out, tuple):  # return_outputs
            loss, outputs = out
            return loss * factor, outputs
        return out * factor

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        if resume_from_checkpoint:
            logger.warning(
                "make_elastic: resume_from_checkpoint=%r is ignored: the newest verified snapshot at %s "
                "is the resume point",
                resume_from_checkpoint,
                self._elastic.checkpoints.manager.url if self._elastic.checkpoints.manager else None,
            )
        try:
            return super().train(None, *args, **kwargs)
        except BaseException:
            self._elastic.close(finished=False)
            raise


_CLASSES: dict[type, type] = {}


def _elastic_class(cls: type[Trainer]) -> type[Trainer]:
    if issubclass(cls, _ElasticTrainer):
        return cls
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Elastic{cls.__name__}", (_ElasticTrainer, cls), {"__module__": cls.__module__})
    return _CLASSES[cls]


class _TrainerStateHolder:
    """The ``TrainerState``'s progress fields as registered state (the Trainer's logs and counters resume)."""

    def __init__(self, trainer: Trainer) -> None:
        self._trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        state = self._trainer.state
        return {name: getattr(state, name) for name in _STATE_FIELDS if hasattr(state, name)}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        state = self._trainer.state
        for name, value in saved.items():
            if hasattr(state, name):
                setattr(state, name, value)


class ElasticCallback(TrainerCallback):
    """The step boundary of :func:`make_elastic` (added by it; see the module docstring)."""

    def __init__(self, trainer: Trainer, session: BoundarySession) -> None:
        self._trainer = trainer
        self._session = session

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        t, s = self._trainer, self._session
        optimizer = t.optimizer
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps the torch one
        assert isinstance(inner, torch.optim.Optimizer), type(inner)
        s.attach(t.accelerator.unwrap_model(t.model_wrapped), inner, t.lr_scheduler)
        if s.restore():
            state.global_step = s.step
            state.epoch = _epoch(s)
            t._globalstep_last_logged = s.step  # the Trainer's loss logging counts from here
            t._initial_global_step = s.step
            logger.info(
                "elastic: resumed at step %d (epoch %d, sample %d of it) from the %s snapshot",
                s.step,
                s.cursor.sampler.epoch,
                s.cursor.sampler.position,
                s.resumed_from,
            )
            if _ended(args, s):  # the snapshot is of the run's end: serve nothing (the Trainer then stops)
                s.batch_sampler.finished = True
                control.should_training_stop = True

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        s = self._session
        s.commit()
        if state.global_step != s.step:
            raise RuntimeError(f"the Trainer's global_step {state.global_step} is not the elastic step {s.step}")
        state.epoch = _epoch(s)
        if _ended(args, s):  # the epochs are the cursor's (a resumed run starts mid-epoch)
            control.should_training_stop = True

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._session.finish()


def _ended(args: TrainingArguments, s: BoundarySession) -> bool:
    """The run reached its end: ``max_steps``, else ``num_train_epochs`` of the cursor's epochs."""
    if args.max_steps > 0:
        return s.step >= args.max_steps
    return s.cursor.sampler.epoch >= args.num_train_epochs


def _epoch(s: BoundarySession) -> float:
    sampler = s.cursor.sampler
    return sampler.epoch + sampler.position / sampler.epoch_size
