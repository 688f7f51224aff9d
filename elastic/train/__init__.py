"""The elastic training loop: what a DDP script calls to become elastic, resumable and (optionally) live.

- :mod:`elastic.train.trainer`: :class:`ElasticTrainer`, the loop (it composes the parts below);
- :mod:`elastic.train.strategy`: :class:`ParallelStrategy`, everything of the loop that depends on the mode
  (one object per mode, :mod:`~elastic.train.strategy_factory` chooses): :mod:`~elastic.train.strategy_ddp`
  (restart mode, DDP), :mod:`~elastic.train.strategy_live` (live recovery, replicated),
  :mod:`~elastic.train.strategy_sharded` (FSDP2/HSDP, restart and live);
- :mod:`elastic.train.config`: :class:`ElasticConfig`, :class:`StepInfo`, and :class:`LiveOptions` (from
  :mod:`elastic.live.protocol`);
- :mod:`elastic.train.cursor`: the training cursor (step, data, LR policy) and its re-split on a resize;
- :mod:`elastic.train.sampler`: the exactly-once, world-size-independent partition of each epoch;
- :mod:`elastic.train.boundary`: the flags every rank agrees on at a step boundary;
- :mod:`elastic.train.snapshots`: the loop's snapshots (restore, the step-boundary decisions, saves);
- :mod:`elastic.train.sharded`: sharded (FSDP2) models: their snapshot layout and gradient accumulation;
- :mod:`elastic.train.schedule`: when a snapshot is taken (pure: steps, time, a busy writer);
- :mod:`elastic.train.preemption`: SIGTERM seen by a watcher thread, answered at the next boundary;
- :mod:`elastic.train.progress`: progress reports to the job service (the wire format is
  :mod:`elastic.contract.progress`);
- :mod:`elastic.train.live`: the live-recovery glue (the group from the environment, the state sync).

Imports run one way: ``train`` → ``live`` → ``checkpoint`` / ``rendezvous`` → ``etcd``, with ``contract``
below them all. Import the API from :mod:`elastic` (lazily) or from the modules; this package imports
nothing at import time, so that the light parts (the sampler, the schedule) stay light.
"""
