"""The checkpoint manager over any fsspec URL: background saves, verified loads, retention.

:func:`create_checkpoint_manager` builds the implementation of :class:`~elastic.checkpoint.api.CheckpointManager`
for ``CheckpointOptions.layout``, once:

- ``replicated``: :class:`~elastic.checkpoint.replicated.ReplicatedCheckpointManager` (one writer rank, a
  background writer thread, staging buffers, the optimizer fence);
- ``sharded``: :class:`~elastic.checkpoint.sharded.ShardedCheckpointManager` (every rank writes its shards
  through DCP, rank 0 commits the manifest), imported only when asked for (``torch.distributed.checkpoint`` takes
  most of a second to import).

Both are :class:`~elastic.checkpoint.base.StorageCheckpointManager`: one storage root, listing, verified loads
with fallback, closing at exit.
"""

from __future__ import annotations

from elastic.checkpoint.api import CheckpointOptions, EventHook, StateLayout
from elastic.checkpoint.base import StorageCheckpointManager, current_rank_and_world
from elastic.checkpoint.replicated import ReplicatedCheckpointManager
from elastic.checkpoint.staging import Stager
from elastic.checkpoint.storage import CheckpointStorage, StripeSettings, create_storage

__all__ = [
    "FsspecCheckpointManager",
    "ReplicatedCheckpointManager",
    "StorageCheckpointManager",
    "create_checkpoint_manager",
    "current_rank_and_world",
]

#: The manager's name before the layouts were split into two classes; it is built directly (tests, node-local
#: slots) for replicated state, which is what it serves now. Build managers with :func:`create_checkpoint_manager`.
FsspecCheckpointManager = ReplicatedCheckpointManager


def create_checkpoint_manager(
    url: str,
    options: CheckpointOptions | None = None,
    *,
    events: EventHook | None = None,
    storage: CheckpointStorage | None = None,
    stager: Stager | None = None,
) -> StorageCheckpointManager:
    """A manager for ``url`` and ``options.layout``; nothing is contacted until ``check_storage``/``save``/
    ``load_latest``.

    ``storage`` replaces the back-end built from ``url`` (wrappers of our own storage interface); ``stager`` the
    staging built from ``options`` (replicated layout; tests: in-memory copy streams and device memory).
    """
    opts = options or CheckpointOptions()
    if storage is None:
        stripe = StripeSettings(opts.lustre_striping, opts.lustre_stripe_count, opts.lustre_stripe_size)
        storage = create_storage(url, opts.storage_options, stripe)
    if opts.layout == StateLayout.SHARDED:
        from elastic.checkpoint.sharded import ShardedCheckpointManager

        return ShardedCheckpointManager(storage, opts, events)
    return ReplicatedCheckpointManager(storage, opts, events, stager=stager)
