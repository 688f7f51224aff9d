"""A model that the trainer shards for each world: ``parallelize(module, mesh) -> module``, called again
whenever the world changes (each process start in restart mode, each generation in live mode).

The mesh handed to ``parallelize`` is 2-D, ``("replicate", "shard")``: ``world // shard_size`` replicas of
``shard_size`` ranks each, rank ``r`` holding shard ``r % shard_size`` of replica ``r // shard_size``. With
``fully_shard(module, mesh=mesh)`` that is HSDP (one replica: plain FSDP). ``shard_size`` defaults to a node's
workers, so a replica is a node: the unit that fails.

In live mode a new generation does not start the model again. :meth:`ShardedModel.build` shards a fresh copy of
the module's structure (kept on the meta device, no memory) on the new mesh, and a member whose shard is the
same one in the new mesh (same replica size, same shard index: the survivors of a lost node) moves its local
shards, buffers and optimizer state into it as they are: its shard group is untouched. Members that hold no
valid shard (a joiner, a member a step behind) receive each shard from a member of their new replicate group
that holds it (:func:`shard_sources` decides, :meth:`ShardedModel.local_payload` and
:meth:`ShardedModel.apply_payload` carry it). When some shard index has no such member (no full replica
survived), the generation restores the newest durable snapshot, which DCP reshards.

The optimizer the script made over the unsharded module follows: its parameter groups are re-pointed at each
build's parameters, matched by name, and its state moved along.
"""

from __future__ import annotations

import copy
import logging
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from elastic.checkpoint.tree import iter_leaves, map_leaves
from elastic.live.state_sync import broadcast_state

__all__ = [
    "REPLICATE",
    "SHARD",
    "GuardedForward",
    "Parallelize",
    "ShardLayout",
    "ShardSources",
    "ShardedModel",
    "check_model",
    "shard_sources",
    "share_shards",
]

logger = logging.getLogger(__name__)

REPLICATE, SHARD = "replicate", "shard"

#: ``parallelize(module, mesh) -> module``: shard the module on the mesh (e.g. ``fully_shard`` per block, then
#: the root) and return it
Parallelize = Callable[[nn.Module, Any], nn.Module]


@dataclass(frozen=True)
class ShardLayout:
    """Which shard of the model a rank holds: ``shard_index`` of ``shard_size``, in one of ``replicas``."""

    shard_size: int
    shard_index: int
    replicas: int

    @staticmethod
    def replica_size(configured: int | None, local_world: int) -> int:
        """The ranks of one replica: the configured number, else one node's workers (a node is a replica)."""
        if configured is not None and configured < 1:
            raise ValueError(f"shard_size must be >= 1 or None, got {configured}")
        return configured if configured is not None else local_world

    @classmethod
    def of(cls, rank: int, world: int, shard_size: int) -> ShardLayout:
        if shard_size < 1 or world % shard_size:
            raise ValueError(f"a replica of {shard_size} ranks does not divide a world of {world}")
        return cls(shard_size, rank % shard_size, world // shard_size)

    def same_shard(self, other: ShardLayout | None) -> bool:
        """Whether a rank that held ``other``'s shard holds this one's: same replica size and shard index (the
        number of replicas may differ: their shards are the same)."""
        return other is not None and (other.shard_size, other.shard_index) == (self.shard_size, self.shard_index)


@dataclass(frozen=True)
class ShardSources:
    """Per shard index of the new world: the rank every member of that replicate group takes its shard from,
    and whether any member of the group needs it (else no broadcast)."""

    sources: tuple[int, ...]
    needed: tuple[bool, ...]


def shard_sources(steps: Sequence[int], kept: Sequence[bool], step: int, shard_size: int) -> ShardSources | None:
    """Decide (pure) from every member, in new rank order: the step its state holds (-1: none) and whether it
    kept its shard in the new layout. A member is a source for its shard index when it kept the shard and holds
    ``step`` (the step the generation continues from); the lowest such rank is the group's. None when a shard
    index has no source: no full replica of ``step`` survived."""
    if len(steps) != len(kept) or not steps or len(steps) % shard_size:
        raise ValueError(f"{len(steps)} members, {len(kept)} claims, replicas of {shard_size}")
    sources: list[int] = []
    needed: list[bool] = []
    for index in range(shard_size):
        group = range(index, len(steps), shard_size)
        holders = [r for r in group if kept[r] and steps[r] == step]
        if not holders:
            return None
        sources.append(holders[0])
        needed.append(any(r not in holders for r in group))
    return ShardSources(tuple(sources), tuple(needed))


def share_shards(
    sharded: ShardedModel,
    plan: ShardSources,
    rank: int,
    device: torch.device,
    loop: dict[str, Any] | None,
    needed_only: bool = True,
) -> dict[str, Any] | None:
    """Within this rank's replicate group, the plan's source sends its shard (:meth:`ShardedModel.local_payload`)
    and ``loop`` (the loop's state: on the source only) to the others, which take the shard as theirs; every rank
    gets ``loop`` back. A collective over the replicate groups; with ``needed_only``, a group none of whose members
    needs the shard (``plan.needed``) sends nothing and its ranks get None."""
    index = rank % sharded.shard_size
    source = plan.sources[index]
    if needed_only and not plan.needed[index]:
        return None
    payload = {"loop": loop, "shards": sharded.local_payload()} if rank == source else None
    received = broadcast_state(payload, source, device, group=sharded.replicate_group())
    if rank != source:
        sharded.apply_payload(received["shards"])
    return dict(received["loop"]) if received["loop"] is not None else None


def _local(t: Any) -> torch.Tensor:
    """This rank's part of a DTensor (the tensor itself otherwise); with grad off, the shard's own storage."""
    with torch.no_grad():
        local = t.to_local() if isinstance(t, DTensor) else t
    assert isinstance(local, torch.Tensor)
    return local


def meta_copy(module: nn.Module) -> nn.Module:
    """The module's structure with every parameter and buffer on the meta device (no memory, no copy of values)."""
    memo: dict[int, Any] = {}
    for p in module.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(module, memo)


def check_model(model: nn.Module, parallelize: Parallelize | None, live: bool) -> None:
    """Refuse what the recovery mode cannot train, before any process group forms (ValueError)."""
    from torch.nn.parallel import DistributedDataParallel

    from elastic import compat

    wrapped, sharded = isinstance(model, DistributedDataParallel), compat.is_sharded_module(model)
    if parallelize is not None and (sharded or wrapped):
        raise ValueError(
            "with parallelize=, pass the unsharded, unwrapped module: the trainer shards it for each world"
        )
    if live and sharded:
        raise ValueError(
            "live recovery shards the model anew for each generation of the group, which a module "
            "sharded already cannot follow: pass the unsharded module and parallelize=fn(module, mesh) "
            "(see elastic.train.parallel), or use recovery='restart'"
        )
    if live and wrapped:
        raise ValueError(
            "live recovery wraps the model in DDP anew for each generation of the group: pass the "
            "module itself, not a DistributedDataParallel"
        )


class ShardedModel:
    """See the module docstring. ``model``: the unsharded module with its initial values (the first world shards
    it; later worlds shard copies of its structure); ``optimizer``: made over ``model``'s parameters."""

    def __init__(
        self,
        model: nn.Module,
        parallelize: Parallelize,
        optimizer: torch.optim.Optimizer,
        shard_size: int,
        device: torch.device,
    ) -> None:
        if shard_size < 1:
            raise ValueError(f"shard_size must be >= 1, got {shard_size}")
        self._template = meta_copy(model)
        self._initial: nn.Module | None = model
        self._parallelize, self._optimizer = parallelize, optimizer
        self.shard_size, self._device = shard_size, device
        self._module: nn.Module | None = None
        self.layout: ShardLayout | None = None
        self.mesh: Any = None

    @property
    def module(self) -> nn.Module:
        if self._module is None:
            raise RuntimeError("the sharded model is built for a world first (ShardedModel.build)")
        return self._module

    def build(self, rank: int, world: int) -> bool:
        """Shard the model for this world (a collective: the mesh's groups form); returns whether this rank kept
        its shard (its values are the model's, as before the change). Raises ValueError when the replica size does
        not divide the world."""
        from torch.distributed.device_mesh import init_device_mesh

        layout = ShardLayout.of(rank, world, self.shard_size)
        mesh = init_device_mesh(
            self._device.type, (layout.replicas, layout.shard_size), mesh_dim_names=(REPLICATE, SHARD)
        )
        old = self._module
        before = old if old is not None else self._initial
        assert before is not None
        names = {id(p): name for name, p in before.named_parameters()}  # parallelize replaces the initial's
        if old is None:
            assert self._initial is not None
            module = self._parallelize(self._initial, mesh)
            self._initial = None
            kept = False  # initial values: the same on every rank only by the script's seed
        else:
            module = self._parallelize(copy.deepcopy(self._template), mesh)
            module.to_empty(device=self._device)
            kept = layout.same_shard(self.layout)
            with torch.no_grad():
                new_buffers = dict(module.named_buffers())
                for name, b in old.named_buffers():  # replicated, and non-persistent ones too
                    new_buffers[name].copy_(b)
                if kept:
                    new_params = dict(module.named_parameters())
                    for name, p in old.named_parameters():
                        _local(new_params[name]).copy_(_local(p))
        self._repoint(names, module, kept)
        self._module, self.layout, self.mesh = module, layout, mesh
        logger.info(
            "sharded model built for %d ranks: %d replica(s) of %d shards, this rank shard %d (%s)",
            world,
            layout.replicas,
            layout.shard_size,
            layout.shard_index,
            "its shards kept" if kept else "shards to be received or restored",
        )
        return kept

    def _repoint(self, names: dict[int, str], new: nn.Module, kept: bool) -> None:
        """The optimizer's groups and state from the old parameters (``names``: by id) to ``new``'s."""
        params = dict(new.named_parameters())
        opt = self._optimizer

        def moved(p: torch.Tensor) -> nn.Parameter:
            name = names.get(id(p))
            if name is None:
                raise ValueError(
                    "the optimizer holds a parameter that is not the model's: make it over "
                    "model.parameters() of the module passed to the trainer"
                )
            return params[name]

        state: dict[Any, dict[str, Any]] = {}
        for p, entry in opt.state.items():
            q = moved(p)
            new_entry: dict[str, Any] = {}
            for key, value in entry.items():
                if isinstance(value, torch.Tensor) and isinstance(q, DTensor) and value.shape == p.shape:
                    fresh = torch.zeros_like(q)
                    if kept:
                        with torch.no_grad():
                            _local(fresh).copy_(_local(value))
                    new_entry[key] = fresh
                else:
                    new_entry[key] = value
            state[q] = new_entry
        for group in opt.param_groups:
            group["params"] = [moved(p) for p in group["params"]]
        opt.state = defaultdict(dict, state)

    # -- a shard from a member of the replicate group ------------------------------------------------------
    def local_payload(self) -> dict[str, Any]:
        """This rank's shards, buffers, optimizer state (local parts) and groups' settings, by name."""
        module, opt = self.module, self._optimizer
        names = {id(p): name for name, p in module.named_parameters()}
        optim: dict[str, dict[str, Any]] = {}
        sharded: dict[str, list[str]] = {}
        for p, entry in opt.state.items():
            name = names[id(p)]
            optim[name] = {k: _local(v) if isinstance(v, DTensor) else v for k, v in entry.items()}
            sharded[name] = sorted(k for k, v in entry.items() if isinstance(v, DTensor))
        return {
            "params": {name: _local(p) for name, p in module.named_parameters()},
            "buffers": dict(module.named_buffers()),
            "optim": optim,
            "sharded": sharded,
            "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
        }

    def apply_payload(self, payload: dict[str, Any]) -> None:
        """Take a member's :meth:`local_payload` (of the same shard index) as this rank's state."""
        module, opt = self.module, self._optimizer
        params = dict(module.named_parameters())
        buffers = dict(module.named_buffers())
        with torch.no_grad():
            for name, value in payload["params"].items():
                _local(params[name]).copy_(value)
            for name, value in payload["buffers"].items():
                buffers[name].copy_(value)
            state: dict[Any, dict[str, Any]] = {}
            for name, entry in payload["optim"].items():
                p = params[name]
                new_entry: dict[str, Any] = {}
                for key, value in entry.items():
                    if key in payload["sharded"][name]:
                        fresh = torch.zeros_like(p)
                        _local(fresh).copy_(value)
                        new_entry[key] = fresh
                    else:
                        new_entry[key] = value
                state[p] = new_entry
        opt.state = defaultdict(dict, state)
        if len(payload["groups"]) != len(opt.param_groups):
            raise ValueError(f"{len(payload['groups'])} parameter groups received, {len(opt.param_groups)} here")
        for group, settings in zip(opt.param_groups, payload["groups"], strict=True):
            group.update(settings)

    def replicate_group(self) -> Any:
        """This rank's replicate group (the ranks holding the same shard index)."""
        return self.mesh.get_group(REPLICATE)

    def placeholder(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """An output shaped like the model's for these inputs (its structure's forward on the meta device: no
        compute, no collective): zeros, floating ones requiring grad, on the inputs' device."""
        device = next((t.device for t in iter_leaves((args, kwargs)) if isinstance(t, torch.Tensor)), self._device)
        on_meta = map_leaves((args, kwargs), lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t)
        meta_args, meta_kwargs = on_meta
        out = self._template(*meta_args, **meta_kwargs)

        def zeros(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            return torch.zeros(t.shape, dtype=t.dtype, device=device, requires_grad=t.dtype.is_floating_point)

        return map_leaves(out, zeros)


class GuardedForward(nn.Module):
    """A sharded module's forward in live mode. FSDP all-gathers parameters in the forward pass, so a peer's
    failure can surface there, inside the script's own ``loss_fn(model(x), y)``. It is caught: ``on_failure(exc)``
    marks the step broken (the trainer drops it and re-forms at its end) and the script gets an output of the
    right shapes (:meth:`ShardedModel.placeholder`) to finish the micro-batch with; its ``backward`` is skipped.
    ``on_failure`` returns False for an error that is not a lost peer, which is raised as it is."""

    def __init__(self, module: nn.Module, sharded: ShardedModel, on_failure: Callable[[RuntimeError], bool]) -> None:
        super().__init__()
        self.module = module
        self._placeholder, self._on_failure = sharded.placeholder, on_failure

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self.module(*args, **kwargs)
        except RuntimeError as exc:
            if not self._on_failure(exc):
                raise
            return self._placeholder(args, kwargs)
