"""The elastic loop's guarantees inside PyTorch Lightning's ``Trainer.fit``: :class:`ElasticDDPStrategy`.

One line in a plain Lightning script (``pip install elastic-train[lightning]``)::

    trainer = L.Trainer(max_epochs=3, strategy=ElasticDDPStrategy(LRPolicy("linear", 0.1, 2, 32), "s3://b/ckpt"))
    trainer.fit(model, datamodule)

It is Lightning's own ``DDPStrategy`` (the process group, the DDP wrap, ``no_sync`` for accumulation, its
precision plugins, the user's callbacks and ``ModelCheckpoint`` all stay Lightning's), with the elastic loop's
pieces in the hooks a strategy owns:

- ``process_dataloader`` (the training loader): the user's ``DataLoader`` (workers, ``collate_fn``, pinned memory)
  is rebuilt over an :class:`~elastic.train.batch_sampler.ElasticBatchSampler` bound to the training cursor
  (:class:`~elastic.train.cursor.TrainingCursor`) instead of Lightning's ``DistributedSampler``: each step takes
  the next samples of the epoch's permutation from the cursor of the last committed step, exactly once across
  resizes; each micro-batch the loader serves is checked against the step's layout
  (:class:`~elastic.train.batch_sampler.LockstepError` otherwise);
- ``setup``: ``trainer.accumulate_grad_batches`` is the LR policy's accumulation for this world (the global batch
  kept under ``fixed-global-batch``); the newest verified snapshot is restored (model, optimizers, LR schedulers,
  the precision plugin's scaler, stateful callbacks, the cursor, RNG) with Lightning's epoch and step counters;
- ``backward``: each micro-batch's loss weighted so that the gradient is the exact mean over the step's samples
  (Lightning divides by ``accumulate_grad_batches``: the factor is 1 but for an epoch's last, uneven step, and 0
  for a padding micro-batch);
- the optimizer's ``step``: the policy's LR factor (with its warmup ramp after a resize) around it
  (:class:`~elastic.train.step.OptimizerGate`; LR schedulers never see it);
- the step boundary: the cursor moves once the step's last micro-batch ended (``on_train_batch_end``, before
  Lightning makes the next epoch's iterator); the boundary's agreement (one all-reduce:
  :class:`~elastic.train.boundary.BoundaryFlags`), its snapshots (:class:`~elastic.train.snapshots.LoopCheckpoints`,
  asynchronous, verified, any fsspec URL) and a SIGTERM's save run when the next step starts (or training ends), so
  that a snapshot holds what Lightning did between the steps too (validation, epoch-end LR schedulers);
- SIGTERM: Lightning's own handler (which broadcasts from inside the signal handler, and stops without saving) is
  replaced for the fit by the loop's :class:`~elastic.train.preemption.PreemptionWatcher`: every rank saves the
  step at the next boundary, the signalled ranks leave with Lightning's ``SIGTERMException`` (exit 143).

Restart mode only: Lightning forms and owns the process group, so a lost peer fails every worker and torchrun
restarts them (warm with ``-m elastic.prefork``); the restart resumes from the newest snapshot at any world.
Under torchrun the world is torchrun's: ``Trainer(devices=, num_nodes=)`` need not match it (an elastic job's
world changes between restarts). See docs/integrations.md.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import torch
from lightning.fabric.plugins.environments import TorchElasticEnvironment
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.utils.data import DataLoader

from elastic import compat
from elastic.checkpoint import capture_training_state
from elastic.checkpoint.state import TrainingState
from elastic.contract.lr import LRPolicy
from elastic.contract.recovery import RecoveryMode
from elastic.integrations.lightning_loader import LoaderCursor, elastic_loader
from elastic.train.agreement import BoundaryAgreement, checked_flags, replicas_agreement
from elastic.train.batch_sampler import ElasticBatchSampler, LockstepError
from elastic.train.boundary import BoundaryFlags
from elastic.train.collectives import HostCollectives
from elastic.train.config import ElasticConfig, StepInfo
from elastic.train.preemption import PreemptionWatcher
from elastic.train.registry import StateRegistry
from elastic.train.sampler import ElasticSampler, StepLayout, step_layout
from elastic.train.schedule import SnapshotStats
from elastic.train.snapshots import LoopCheckpoints
from elastic.train.step import OptimizerGate
from elastic.train.step_loss import StepLoss
from elastic.train.stop_timeout import StopTimeout

logger = logging.getLogger(__name__)

__all__ = ["ElasticDDPStrategy", "TorchrunEnvironment"]

#: the Trainer's attribute for its argument ``reload_dataloaders_every_n_epochs`` (set by its data connector)
RELOAD = "reload_dataloaders_every_n_epochs"


class TorchrunEnvironment(TorchElasticEnvironment):
    """torchrun's environment, whatever ``Trainer(devices=, num_nodes=)`` say: the world, the ranks and the node
    come from torchrun's variables (as in Lightning's ``TorchElasticEnvironment``), and a product of ``devices`` and
    ``num_nodes`` other than torchrun's world is not an error, since an elastic job's world changes at every
    restart (nodes may also run different numbers of workers)."""

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        if num_devices * num_nodes != self.world_size():
            logger.debug(
                "Trainer(devices=%d, num_nodes=%d): the world is torchrun's, %d",
                num_devices,
                num_nodes,
                self.world_size(),
            )


class _Boundary(Callback):
    """The strategy's hold on the end of each training batch (a strategy has no hook there)."""

    def __init__(self, strategy: ElasticDDPStrategy) -> None:
        self._strategy = strategy

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._strategy._micro_batch_done()


@dataclasses.dataclass
class _Committed:
    """A step whose cursor moved; its boundary (agreement, snapshots, SIGTERM) runs when the next step starts."""

    stepped: int
    epoch_done: bool


class ElasticDDPStrategy(DDPStrategy):
    """Lightning's ``DDPStrategy`` with the elastic loop's guarantees (see the module docstring).

    Args:
        config: the LR policy (``LRPolicy``: the rule, base LR, base world, per-worker micro-batch, accumulation), or
            the loop's whole :class:`~elastic.train.config.ElasticConfig` (``save_every_steps``, ``save_every``,
            ``seed``, checkpoint options, ...). ``recovery="live"`` is refused: Lightning owns the process group.
        checkpoint_url: where the snapshots go (any fsspec URL; default ``$ETRAIN_CHECKPOINT_URL``).
        state: more objects with ``state_dict``/``load_state_dict`` to save and restore, by name.
        on_step: called with each committed step's :class:`~elastic.train.config.StepInfo` on this rank.
        **kwargs: ``DDPStrategy``'s own (``find_unused_parameters``, ``static_graph``, ``timeout``, ...).
    """

    def __init__(
        self,
        config: LRPolicy | ElasticConfig,
        checkpoint_url: str | None = None,
        *,
        state: Mapping[str, Any] | None = None,
        on_step: Callable[[StepInfo], None] | None = None,
        **kwargs: Any,
    ) -> None:
        if isinstance(config, LRPolicy):
            config = ElasticConfig(config, checkpoint_url)
        elif checkpoint_url is not None:
            config = replace(config, checkpoint_url=checkpoint_url)
        if config.recovery is RecoveryMode.LIVE:
            raise ValueError(
                "recovery='live' under Lightning: Lightning forms and owns the process group, so the "
                "group cannot re-form in process; leave recovery unset (restart mode, warm restarts "
                "with -m elastic.prefork)"
            )
        if kwargs.get("start_method", "popen") != "popen":
            raise ValueError("ElasticDDPStrategy runs under torchrun (start_method='popen'), not spawned processes")
        if kwargs.get("cluster_environment") is None and TorchElasticEnvironment.detect():
            kwargs["cluster_environment"] = TorchrunEnvironment()
        kwargs.setdefault("timeout", config.timeout)
        if config.backend is not None:
            kwargs.setdefault("process_group_backend", config.backend)
        super().__init__(**kwargs)
        self.config = config
        self._on_step = on_step
        self._user_state = dict(state or {})
        self._registry = StateRegistry()
        self._cursor: LoaderCursor | None = None
        self._fresh_sampler = True  # no snapshot restored: the sampler is made from the training loader
        self._checkpoints: LoopCheckpoints | None = None
        self._host: HostCollectives | None = None
        self._agreement: BoundaryAgreement | None = None  # the boundary's flags, overlapped with the next step
        self._gate: OptimizerGate | None = None
        self._watcher: PreemptionWatcher | None = None
        self._stop_timeout: StopTimeout | None = None
        self._batch_sampler: ElasticBatchSampler | None = None
        self._loss = StepLoss()
        self._layout: StepLayout | None = None
        self._micro = 0  # the micro-batch of the step being served
        self._factor = 1.0  # the current micro-batch's loss factor on top of Lightning's 1 / accumulation
        self._weight = 1.0  # the current micro-batch's share of the step (0: padding)
        self._lr_applied = 0.0
        self._committed: _Committed | None = None
        self._reload_restore: int | None = None  # the user's reload_dataloaders_every_n_epochs, to put back
        self._closed = False
        self._stopped = False

    # -- the world is torchrun's -----------------------------------------------------------------------
    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """For Lightning's samplers of the other loaders (validation): the world is the cluster environment's."""
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def setup_environment(self) -> None:
        devices = self.parallel_devices
        if devices and self.local_rank >= len(devices) and all(d.type == "cpu" for d in devices):
            self.parallel_devices = [torch.device("cpu")] * (self.local_rank + 1)  # CPU workers share the CPU
        super().setup_environment()

    # -- set-up: the restore ---------------------------------------------------------------------------
    def setup(self, trainer: Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        compat.check_torch_version()
        self._check_trainer(trainer)
        rank, world = self.global_rank, self.world_size
        device = self.root_device
        self._host = HostCollectives.for_loop(device, self.config.timeout, live=False)
        self._agreement = replicas_agreement(self.world_size, self._host.device, self._host.group)
        policy = self.config.lr_policy
        self._cursor = LoaderCursor(policy, ElasticSampler(1), rank, world, self._registry)
        optimizers = list(self.optimizers)
        for i, extra in enumerate(optimizers[1:], start=1):
            self._registry.register(f"optimizer.{i}", extra)
        schedulers = [config.scheduler for config in trainer.lr_scheduler_configs]
        for i, scheduler in enumerate(schedulers[1:], start=1):
            self._registry.register(f"scheduler.{i}", scheduler)
        self._registry.register("lightning.precision", self.precision_plugin)
        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            if not isinstance(callback, _Boundary) and callback.state_dict():
                self._registry.register(f"lightning.callback.{callback.state_key}", callback)
        for name, obj in self._user_state.items():
            self._registry.register(name, obj)
        self._checkpoints = LoopCheckpoints(self.config, None, device)
        restored = self._checkpoints.restore(
            self._module, optimizers[0], schedulers[0] if schedulers else None, self._cursor, rank, world
        )
        self._registry.close()
        plan = self._cursor.policy.step_plan(world)
        trainer.accumulate_grad_batches = plan.accumulation_steps
        self._gate = OptimizerGate(optimizers, lambda: self._lr_factor, lambda: False)
        self._stop_timeout = StopTimeout(self.config.stop_timeout, lambda: self._step)
        trainer.callbacks.append(_Boundary(self))  # type: ignore[attr-defined]
        if restored:
            self._fresh_sampler = False
            self._restore_counters(trainer)
        logger.info(
            "elastic: %s at step %d, world %d: %d micro-batch(es) of %d per rank and step, global batch %d",
            "resumed" if restored else "starting",
            self._step,
            world,
            plan.accumulation_steps,
            plan.micro_batch,
            plan.global_batch,
        )

    def _check_trainer(self, trainer: Trainer) -> None:
        policy = self.config.lr_policy
        if trainer.ckpt_path is not None:
            raise ValueError(
                f"Trainer.fit(ckpt_path={trainer.ckpt_path!r}): ElasticDDPStrategy resumes from the "
                "newest verified snapshot at its checkpoint URL itself; leave ckpt_path out"
            )
        if trainer.limit_train_batches not in (1.0, None) or getattr(trainer, "overfit_batches", False):
            raise ValueError(
                "limit_train_batches and overfit_batches end Lightning's epochs before the elastic "
                "sampler's: leave them unset under ElasticDDPStrategy"
            )
        if trainer.accumulate_grad_batches not in (1, policy.accumulation_steps):
            raise ValueError(
                f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}): the accumulation "
                "is the LR policy's (LRPolicy(accumulation_steps=...)), adjusted to each world"
            )
        module = trainer.lightning_module
        if not module.automatic_optimization and any(
            policy.step_plan(w).accumulation_steps > 1 for w in (1, policy.base_world_size)
        ):
            raise ValueError(
                "manual optimization with gradient accumulation: Lightning accumulates only under "
                "automatic optimization"
            )

    def _restore_counters(self, trainer: Trainer) -> None:
        """Lightning's epoch and step counters from the restored cursor (Lightning's own checkpoint is not used: its
        loop state is that of one world's batches)."""
        assert self._cursor is not None
        fit_loop = trainer.fit_loop
        epoch_loop = fit_loop.epoch_loop
        _advance(fit_loop.epoch_progress, self._cursor.sampler.epoch)
        if trainer.lightning_module.automatic_optimization:
            _advance(epoch_loop.automatic_optimization.optim_progress.optimizer.step, self._step)
        else:
            _advance(epoch_loop.manual_optimization.optim_step_progress, self._step)
        epoch_loop._batches_that_stepped = self._step
        if self._cursor.sampler.position > 0 and not getattr(trainer, RELOAD, 0):
            # the first epoch is what is left of the saved one: Lightning counts its batches (and places its
            # validation) from the loader's length, so it requests the loader again for the next, whole epoch
            self._reload_restore = getattr(trainer, RELOAD, 0)
            setattr(trainer, RELOAD, 1)

    # -- the training loader ---------------------------------------------------------------------------
    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if self._cursor is None or trainer is None or not trainer.training or trainer.sanity_checking:
            return dataloader
        if self._batch_sampler is not None and self._reload_restore is not None:
            setattr(trainer, RELOAD, self._reload_restore)  # the whole epochs' loader from now on
            self._reload_restore = None
        return self._elastic_loader(dataloader)

    def _elastic_loader(self, dl: object) -> DataLoader[Any]:
        assert self._cursor is not None
        loader, self._batch_sampler = elastic_loader(
            dl, self._cursor, self.config.seed, self.global_rank, self.world_size, fresh=self._fresh_sampler
        )
        return loader

    # -- the steps -------------------------------------------------------------------------------------
    @property
    def _module(self) -> torch.nn.Module:
        module = self.lightning_module
        assert module is not None
        return module

    @property
    def _step(self) -> int:
        return self._cursor.step if self._cursor is not None else 0

    @property
    def _lr_factor(self) -> float:
        return self._cursor.lr_factor if self._cursor is not None else 1.0

    @property
    def elastic_step(self) -> int:
        """The committed steps (Lightning's ``global_step`` once the boundary ran)."""
        return self._step

    @property
    def micro_batch_weight(self) -> float:
        """The current micro-batch's share of its step's samples (0: a padding micro-batch, whose loss counts 0)."""
        return self._weight

    @property
    def lr_factor(self) -> float:
        """The LR policy's factor in force (with its warmup ramp after a resize)."""
        return self._lr_factor

    @property
    def preemption_requested(self) -> bool:
        """A SIGTERM arrived: the step in progress is saved at its boundary, then this worker leaves."""
        return self._watcher is not None and self._watcher.requested

    @property
    def snapshot_stats(self) -> SnapshotStats | None:
        return self._checkpoints.stats if self._checkpoints is not None else None

    @property
    def resumed_from(self) -> str | None:
        """Which tier the start-up restore used: ``"durable"``, ``"node-local"``, or None (a fresh start)."""
        return self._checkpoints.source if self._checkpoints is not None else None

    def register_state(self, name: str, obj: Any) -> None:
        """Save and restore ``obj`` with every snapshot (before ``Trainer.fit``; or pass ``state=``)."""
        self._user_state[name] = obj

    def on_train_start(self) -> None:
        super().on_train_start()
        if self._cursor is None:
            return
        # after Lightning's signal handlers (registered at the start of fit): its SIGTERM handler broadcasts from
        # inside the handler and stops without a save; the loop's watcher replaces it for the fit
        assert self._stop_timeout is not None
        self._watcher = PreemptionWatcher(on_signal=self._stop_timeout.arm).install()

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self._cursor is None or self._batch_sampler is None:
            return
        if self._micro == 0:
            self._boundary()
            plan = self._cursor.policy.step_plan(self.world_size)
            self._layout = step_layout(self._cursor.sampler, plan.global_batch, plan.accumulation_steps)
        layout = self._layout
        assert layout is not None
        j = self._micro
        served = self._batch_sampler.consumed()
        expected = layout.micro[j] or [layout.pad_index]
        if served != expected:
            raise LockstepError(
                f"step {self._step + 1}, micro-batch {j}: the loader served {served[:8]}..., the "
                f"cursor expected {expected[:8]}..."
            )
        self._weight = layout.weight(j, self.world_size)
        self._factor = self._weight * len(layout.micro)  # Lightning divides each micro-batch's loss by their number

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self._cursor is not None and self._layout is not None:
            if self._weight > 0:
                self._loss.add(closure_loss, self._factor)  # the step's loss: the weighted sum of the user's losses
            if self._factor != 1.0:
                closure_loss = closure_loss * self._factor
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        if self._cursor is not None and optimizer is self.optimizers[0]:
            self._lr_applied = float(optimizer.param_groups[0]["lr"]) * self._lr_factor
        return super().optimizer_step(optimizer, closure, model, **kwargs)

    def _micro_batch_done(self) -> None:
        """A training batch ended (its optimizer step and the LR schedulers' ran): the step's last one moves the
        cursor, before Lightning makes the next epoch's iterator."""
        if self._cursor is None or self._layout is None:
            return
        self._micro += 1
        if self._micro < len(self._layout.micro):
            return
        assert self._gate is not None
        layout, self._layout, self._micro = self._layout, None, 0
        stepped = self._gate.take()
        epoch = self._cursor.sampler.epoch
        epoch_done = self._cursor.sampler.advance(layout.total)
        self._cursor.step += 1
        loss = self._loss.take()
        self._committed = _Committed(stepped, epoch_done)
        if self._on_step is not None:
            self._on_step(
                StepInfo(
                    self._step, epoch, self.global_rank, self.world_size, list(layout.indices), self._lr_applied, loss
                )
            )

    def _boundary(self) -> None:
        """The boundary of the step committed last (a collective): the agreed flags, the snapshots they call for,
        the SIGTERM save (the signalled ranks then leave with exit 143)."""
        committed, self._committed = self._committed, None
        if committed is None:
            return
        assert self._checkpoints is not None and self._host is not None and self._cursor is not None
        assert self._stop_timeout is not None
        self._stop_timeout.boundary()
        signalled = self._watcher is not None and self._watcher.requested
        step, agreement, checkpoints = self._step, self._agreement, self._checkpoints
        assert agreement is not None

        def mine(acted_at: int) -> BoundaryFlags:  # this rank's view of boundary `acted_at`, when asked
            flags = checkpoints.local_flags(acted_at, time.monotonic(), signalled, self.global_rank)
            return flags.with_steps(committed.stepped, joiners=False)

        needed = checkpoints.flags_needed(step, committed.epoch_done)
        flags = checked_flags(agreement.agreed(step, committed.stepped, mine, needed=needed))
        if flags is not None and flags.signalled:
            self._stop_timeout.reached()
        optimizer = self.optimizers[0]
        self._checkpoints.warm_up(self._module, optimizer, self._scheduler, self._cursor)
        if self._checkpoints.act(
            flags, step, committed.epoch_done, self.global_rank, signalled, self._capture, optimizer
        ):
            self._stopped = True
            self._close(finished=False)
            raise SIGTERMException(143)
        agreement.launch(step, mine, soon=checkpoints.flags_needed(step + 1, epoch_done=False))

    @property
    def _scheduler(self) -> Any:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        configs = trainer.lr_scheduler_configs if trainer is not None else []
        return configs[0].scheduler if configs else None

    def _capture(self) -> TrainingState:
        """References to the full state (a collective: gathers every rank's RNG state)."""
        assert self._cursor is not None and self._host is not None
        return capture_training_state(
            self._step,
            self._module,
            self.optimizers[0],
            self._scheduler,
            process_group=self._host.group(),
            **self._cursor.state(),
        )

    def on_train_end(self) -> None:
        """Training ended on every rank: the last boundary, then the last step saved unless a snapshot of it exists."""
        super().on_train_end()
        if self._cursor is None or self._closed:
            return
        self._boundary()
        if self._agreement is not None:
            checked_flags(self._agreement.drain())  # the last boundary's, in flight: its steps are checked
        checkpoints = self._checkpoints
        assert checkpoints is not None
        if checkpoints.manager is not None and checkpoints.stats.last_saved_step != self._step:
            logger.info("training ended at step %d: saving it", self._step)
            checkpoints.save(self._step, self._capture, self.optimizers[0], blocking=True)
        self._close(finished=True)

    def save_elastic(self, blocking: bool = False) -> None:
        """A snapshot of the last committed step now (a collective: every rank calls it, between steps)."""
        assert self._checkpoints is not None
        self._checkpoints.save(self._step, self._capture, self.optimizers[0], blocking)

    def _close(self, finished: bool) -> None:
        if self._closed:
            return
        self._closed = True
        if self._agreement is not None:
            self._agreement.discard()
        if self._stop_timeout is not None:
            self._stop_timeout.reached()
        if self._watcher is not None:
            self._watcher.uninstall()  # Lightning's handler back (its teardown then puts back the one before fit)
        if self._gate is not None:
            self._gate.close()
        if self._checkpoints is not None:
            self._checkpoints.close(finished=finished)

    def teardown(self) -> None:
        try:
            self._close(finished=False)
        finally:
            super().teardown()


def _advance(progress: Any, n: int) -> None:
    """Count ``n`` more completed events in one of Lightning's progress trackers (its total and current parts; the
    fields each kind of tracker has: ``ready``, ``started``, ``processed``, ``completed``)."""
    for tracker in (progress.total, progress.current):
        for name in ("ready", "started", "processed", "completed"):
            if hasattr(tracker, name):
                setattr(tracker, name, getattr(tracker, name) + n)
