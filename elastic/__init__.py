"""Elastic, fault-tolerant training for stock torchrun: etcd v3 rendezvous, checkpoints, elastic loop.

The training API is importable from here (lazily, so that loading the torchrun plugin stays light)::

    from elastic import ElasticBatchSampler, ElasticConfig, ElasticTrainer, LRPolicy
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "ElasticConfig": "elastic.train.config",
    "ElasticTrainer": "elastic.train.trainer",
    "StepInfo": "elastic.train.config",
    "LRPolicy": "elastic.contract.lr",
    "LRRule": "elastic.contract.lr",
    "ElasticSampler": "elastic.train.sampler",
    "ElasticBatchSampler": "elastic.train.batch_sampler",
    "LiveOptions": "elastic.train.config",
    "RecoveryMode": "elastic.train.config",
    "RegistrationError": "elastic.train.registry",
    "Stateful": "elastic.train.registry",
    "Step": "elastic.train.step",
    "StepMismatchError": "elastic.train.step",
    "WriterBusy": "elastic.train.schedule",
}

__all__ = [
    "ElasticBatchSampler",
    "ElasticConfig",
    "ElasticSampler",
    "ElasticTrainer",
    "LRPolicy",
    "LRRule",
    "LiveOptions",
    "RecoveryMode",
    "RegistrationError",
    "Stateful",
    "Step",
    "StepInfo",
    "StepMismatchError",
    "WriterBusy",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'elastic' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
