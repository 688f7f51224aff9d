"""A worker's live group from its environment: the etcd connection (``ETRAIN_ETCD_*``), the group's prefix
and node range (``ETRAIN_LIVE_*``, written by the ``etcd-v3`` handler with ``recovery=live``), and torchrun's
``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE``."""

from __future__ import annotations

import os
import socket

import torch

from elastic.env import LIVE_PREFIX, WorkerEnv
from elastic.etcd import create_client
from elastic.live.group import LiveGroup
from elastic.live.membership import LiveMembership, LiveSettings, new_worker_id
from elastic.live.protocol import LiveKeys
from elastic.loop_config import ElasticConfig

__all__ = ["LiveSetupError", "open_live_group"]


class LiveSetupError(RuntimeError):
    """Live recovery was asked for but the worker's environment does not say where its group lives."""


def open_live_group(config: ElasticConfig) -> LiveGroup:
    """Register this worker in its job's live group (it joins with :meth:`LiveGroup.join`)."""
    env = WorkerEnv.from_environ()
    if env.live is None:
        raise LiveSetupError(f"recovery='live' needs {LIVE_PREFIX}: run under torchrun with --rdzv-backend=etcd-v3 "
                             "--rdzv-conf recovery=live, or set it and ETRAIN_LIVE_NODES")  # fmt: skip
    if env.etcd is None:
        raise LiveSetupError("recovery='live' needs the etcd connection (ETRAIN_ETCD_ENDPOINTS)")
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    node = env.job.node_name if env.job is not None else socket.gethostname()
    o = config.live
    settings = LiveSettings(
        env.live.min_nodes * per_node, env.live.max_nodes * per_node, ttl=o.ttl, settle=o.settle,
        last_call=o.last_call, join_timeout=o.join_timeout, reform_timeout=o.reform_timeout,
    )  # fmt: skip
    client = create_client(env.etcd.config())
    keys = LiveKeys(env.live.prefix)
    membership = LiveMembership(client, keys, new_worker_id(node, local_rank), settings, node=node)
    backend = config.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device("cuda", local_rank) if backend == "nccl" else None
    return LiveGroup(client, keys, membership, backend, config.timeout, device=device)
