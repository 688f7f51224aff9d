"""Live mode's gradient all-reduce overlaps the backward pass, and gives what the post-backward one gave.

- In one process (gloo, world 1): buckets are launched while backward still runs (a probe in the graph,
  whose backward runs after the later layers', sees them in flight); ``no_sync`` micro-batches launch
  nothing; a parameter unused in the step is sent at the boundary with zeros; mixed dtypes get buckets of
  their own; a gradient accumulated again after its bucket left is a clear error.
- In two processes (gloo over a FileStore, each rank with its own data): the overlapped gradients are bit
  for bit those of the post-backward bucketed all-reduce the loop used before (kept here as the reference),
  with gradient accumulation, a parameter unused on one rank only, mixed dtypes and many small buckets.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from elastic.live.buckets import assign_buckets
from elastic.live.grads import GradientReadyTwiceError, GradientReducer, LiveDataParallel
from tests.ranks import start_ranks


class Probe(torch.autograd.Function):
    """Identity; its backward records how many buckets the reducer has in flight at that moment."""

    seen: list[int] = []
    reducer: GradientReducer | None = None

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        assert Probe.reducer is not None
        Probe.seen.append(Probe.reducer.in_flight)
        return grad


class Net(nn.Module):
    """Four layers (the probe after the first); ``unused``: a layer the forward skips when asked;
    ``mixed``: the last layer in float64."""

    def __init__(self, mixed: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
        self.unused = nn.Linear(16, 16)
        self.head = nn.Linear(16, 1, dtype=torch.float64 if mixed else torch.float32)

    def forward(self, x: torch.Tensor, skip_unused: bool = True, probe: bool = False) -> torch.Tensor:
        x = torch.tanh(self.layers[0](x))
        if probe:
            x = Probe.apply(x)
        for layer in self.layers[1:]:
            x = torch.tanh(layer(x))
        if not skip_unused:
            x = self.unused(x)
        return self.head(x.to(self.head.weight.dtype)).float()


def _loss(model: nn.Module, seed: int, **kwargs: Any) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)
    return nn.functional.mse_loss(model(x, **kwargs), y)


@pytest.mark.timeout(60)
def test_buckets_are_launched_while_backward_runs(gloo_world_1: None) -> None:
    net = Net()
    reducer = GradientReducer(net, bucket_bytes=1)  # a bucket per parameter, sent in reverse order
    Probe.reducer, Probe.seen = reducer, []
    model = LiveDataParallel(net, reducer)
    total = len(reducer.buckets)  # 12: head, unused, layers 3..0 (weight and bias each)
    # step 1: the probe after layer 0 sees the head's two buckets sent; the unused layer's bucket (next in order)
    # never completes, so the ones behind it wait for the boundary
    _loss(model, 1, probe=True).backward()
    assert Probe.seen == [2] and reducer.in_flight == 2
    reducer.finish(world_size=1)
    assert (reducer.stats.overlapped, reducer.stats.at_boundary) == (2, total - 2)
    assert torch.equal(net.unused.weight.grad, torch.zeros_like(net.unused.weight))  # type: ignore[arg-type]
    assert reducer.find_unused
    # step 2: unused parameters are found after the forward, so everything but layer 0 is out when the probe runs
    _loss(model, 2, probe=True).backward()
    assert Probe.seen == [2, total - 2] and reducer.in_flight == total
    reducer.finish(world_size=1)
    assert (reducer.stats.overlapped, reducer.stats.at_boundary) == (2 + total, total - 2)
    reducer.close()


@pytest.mark.timeout(60)
def test_no_sync_micro_batches_launch_nothing_and_the_last_sends_the_sum(gloo_world_1: None) -> None:
    net, reference = Net(), Net()
    reducer = GradientReducer(net, bucket_bytes=4096)
    model = LiveDataParallel(net, reducer)
    with model.no_sync():
        _loss(model, 1, skip_unused=False).backward()
    assert reducer.in_flight == 0
    _loss(model, 2, skip_unused=False).backward()
    assert reducer.in_flight == len(reducer.buckets)
    reducer.finish(world_size=1)
    _loss(reference, 1, skip_unused=False).backward()
    _loss(reference, 2, skip_unused=False).backward()
    for (name, p), q in zip(net.named_parameters(), reference.parameters(), strict=True):
        expected = q.grad if q.grad is not None else torch.zeros_like(q)
        assert p.grad is not None and torch.equal(p.grad, expected), name
    reducer.close()


@pytest.mark.timeout(60)
def test_a_forward_outside_the_wrapper_is_reduced_at_the_boundary(gloo_world_1: None) -> None:
    net = Net()
    reducer = GradientReducer(net)
    _loss(net, 1).backward()  # not through LiveDataParallel: nothing armed
    assert reducer.in_flight == 0
    reducer.finish(world_size=1)
    assert reducer.stats.overlapped == 0 and reducer.stats.at_boundary == len(reducer.buckets)
    reducer.close()


@pytest.mark.timeout(60)
def test_mixed_dtypes_get_buckets_of_their_own() -> None:
    net = Net(mixed=True)
    params = [p for p in net.parameters() if p.requires_grad]
    buckets = assign_buckets(params, limit=2**30)
    assert sorted(str(b.dtype) for b in buckets) == ["torch.float32", "torch.float64"]
    assert sorted(i for b in buckets for i in b.params) == list(range(len(params)))
    assert buckets[0].params[0] == len(params) - 1  # the last parameter is sent first
    with pytest.raises(ValueError, match="positive"):
        assign_buckets(params, limit=0)


@pytest.mark.timeout(60)
def test_a_gradient_accumulated_after_its_bucket_left_is_a_clear_error(gloo_world_1: None) -> None:
    net = Net()
    reducer = GradientReducer(net, bucket_bytes=1)
    model = LiveDataParallel(net, reducer)
    loss = _loss(model, 1)
    loss.backward(retain_graph=True)
    with pytest.raises(GradientReadyTwiceError, match="one backward per forward"):
        loss.backward()
    reducer.reset()
    _loss(model, 2).backward()  # the next step is not affected
    reducer.finish(world_size=1)
    reducer.close()


@pytest.mark.timeout(60)
def test_a_parameter_frozen_later_keeps_no_gradient_and_one_unfrozen_later_is_a_clear_error(
    gloo_world_1: None,
) -> None:
    net = Net()
    reducer = GradientReducer(net, bucket_bytes=1)
    model = LiveDataParallel(net, reducer)
    net.layers[1].requires_grad_(False)  # frozen after the reducer was built: an optimizer must not move it
    _loss(model, 1, skip_unused=False).backward()
    reducer.finish(world_size=1)
    assert net.layers[1].weight.grad is None and net.layers[1].bias.grad is None
    assert net.layers[2].weight.grad is not None
    net.layers[1].requires_grad_(True)  # back, and never frozen at build time: fine
    frozen_at_build = Net()
    frozen_at_build.head.requires_grad_(False)
    late = GradientReducer(frozen_at_build, bucket_bytes=1)
    frozen_at_build.head.requires_grad_(True)  # its gradients would never be averaged
    _loss(LiveDataParallel(frozen_at_build, late), 2).backward()
    with pytest.raises(RuntimeError, match=r"head\.weight, head\.bias require a gradient but did not"):
        late.finish(world_size=1)
    reducer.close()
    late.close()


def _aliases(grad: torch.Tensor, buffers: list[torch.Tensor | None]) -> bool:
    return any(
        flat is not None and flat.data_ptr() <= grad.data_ptr() < flat.data_ptr() + flat.numel() * flat.element_size()
        for flat in buffers
    )


def _in_bucket(reducer: GradientReducer, grad: torch.Tensor) -> bool:
    return _aliases(grad, reducer._flat)


@pytest.mark.timeout(60)
def test_averaged_gradients_are_views_of_the_buckets_under_either_zero_grad(gloo_world_1: None) -> None:
    """No copy back (DDP's gradient_as_bucket_view): the average is left in the bucket, and the next step's
    gradients, made anew (set_to_none) or added into the views (set_to_none=False), are what is sent."""
    net, reference = Net(), Net()
    reducer = GradientReducer(net, bucket_bytes=4096)
    model = LiveDataParallel(net, reducer)
    for step, set_to_none in enumerate((True, False, False, True, False)):
        net.zero_grad(set_to_none=set_to_none)
        reference.zero_grad(set_to_none=set_to_none)
        with model.no_sync():
            _loss(model, 10 + step, skip_unused=False).backward()
        _loss(model, step, skip_unused=False).backward()
        reducer.finish(world_size=1)
        _loss(reference, 10 + step, skip_unused=False).backward()
        _loss(reference, step, skip_unused=False).backward()
        for (name, p), q in zip(net.named_parameters(), reference.parameters(), strict=True):
            assert p.grad is not None and q.grad is not None and torch.equal(p.grad, q.grad), f"step {step}: {name}"
            assert _in_bucket(reducer, p.grad), f"step {step}: {name}'s gradient is a copy, not the bucket's view"
    reducer.close()


def _dropped_step_worker(rank: int, store_path: str, out: str) -> None:
    """Rank 0 sends its buckets during backward and drops the step (reset) before rank 1 has sent anything; rank 1
    then sends, so rank 0's abandoned all-reduce completes late, into the buffer it dropped. The ranks signal each
    other through the store: a barrier would queue behind rank 0's abandoned collectives."""
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        net = Net()
        reducer = GradientReducer(net, bucket_bytes=1)
        model = LiveDataParallel(net, reducer)
        result: dict[str, Any] = {}
        _loss(model, 0, skip_unused=False).backward()  # a complete step: the gradients are the buckets' views
        reducer.finish(world_size=2)
        net.zero_grad(set_to_none=False)  # ... zeroed in place: the next backward adds into the buckets
        if rank == 0:
            _loss(model, 1, skip_unused=False).backward()
            result["in_flight"] = reducer.in_flight
            works, buffers = list(reducer._works), list(reducer._flat)
            result["aliased_before"] = sum(p.grad is not None and _aliases(p.grad, buffers) for p in net.parameters())
            reducer.reset()  # the step is dropped: a late write must land nowhere the loop reads
            result["grads_left"] = sum(p.grad is not None and _aliases(p.grad, buffers) for p in net.parameters())
            store.set("dropped", "1")  # rank 1 sends its buckets now
            for _, work in works:
                work.wait()  # rank 0's abandoned all-reduces complete, late
        else:
            store.wait(["dropped"])
            _loss(model, 2, skip_unused=False).backward()
            reducer.finish(world_size=2)  # pairs with rank 0's abandoned buckets
        net.zero_grad(set_to_none=True)
        _loss(model, 3 + rank, skip_unused=False).backward()  # the next step, on both ranks
        reducer.finish(world_size=2)
        result["grads"] = [p.grad.clone() for p in net.parameters() if p.grad is not None]
        torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_a_dropped_step_leaves_no_gradient_in_a_bucket_still_in_flight(tmp_path: Path) -> None:
    start_ranks(_dropped_step_worker, (str(tmp_path / "store"), str(tmp_path)), 2)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert r0["in_flight"] > 0, "nothing was in flight when the step was dropped: the test proves nothing"
    assert r0["aliased_before"] == 12, "the gradients were not the buckets' views: the test proves nothing"
    assert r0["grads_left"] == 0, "a gradient still aliased a bucket whose all-reduce was abandoned"
    assert len(r0["grads"]) == len(r1["grads"]) == 12
    for i, (a, b) in enumerate(zip(r0["grads"], r1["grads"], strict=True)):
        assert torch.equal(a, b), f"parameter {i}: the step after the dropped one differs between the ranks"


@dataclass
class _Out:
    prediction: torch.Tensor
    extra: int = 0


class _DataclassNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = Net()

    def forward(self, x: torch.Tensor) -> _Out:
        return _Out(self.net(x))


@pytest.mark.timeout(60)
def test_outputs_in_a_dataclass_are_searched_for_the_used_parameters(gloo_world_1: None) -> None:
    module = _DataclassNet()
    reducer = GradientReducer(module, bucket_bytes=1)
    model = LiveDataParallel(module, reducer)
    x, y = torch.randn(8, 16), torch.randn(8, 1)
    for _ in range(3):  # the first step finds the unused layer; then the forward's dataclass is searched
        nn.functional.mse_loss(model(x).prediction, y).backward()
        reducer.finish(world_size=1)
    assert reducer.find_unused and reducer.stats.steps == 3
    reducer.close()


# -- two processes: bit for bit the post-backward all-reduce -----------------------------------------------
def _reference_all_reduce(module: nn.Module, world_size: int, bucket_bytes: int) -> None:
    """The loop's gradient averaging before the overlap (post-backward, buckets in parameter order), with DDP's
    numerics (each gradient times 1 / world, then summed)."""
    params = [p for p in module.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params if p.grad is not None]
    bucket: list[torch.Tensor] = []
    buckets, size = [], 0
    for t in grads:
        if bucket and (size + t.numel() * t.element_size() > bucket_bytes or t.dtype != bucket[0].dtype):
            buckets.append(bucket)
            bucket, size = [], 0
        bucket.append(t)
        size += t.numel() * t.element_size()
    buckets.append(bucket)
    for b in buckets:
        flat = _flatten_dense_tensors(b).mul_(1.0 / world_size)  # divided before the sum, as DDP does
        dist.all_reduce(flat)
        for g, reduced in zip(b, _unflatten_dense_tensors(flat, b), strict=True):
            g.copy_(reduced)


def _two_rank_worker(rank: int, store_path: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    try:
        results: dict[str, list[torch.Tensor]] = {}
        for bucket_bytes in (256, 25 * 2**20):
            overlapped, reference = Net(mixed=True), Net(mixed=True)
            reducer = GradientReducer(overlapped, bucket_bytes=bucket_bytes)
            model = LiveDataParallel(overlapped, reducer)
            for step in range(3):
                skip = rank == 1 or step == 2  # the unused layer: used on rank 0 only, and not in step 2
                with model.no_sync():
                    _loss(model, 10 * step + rank, skip_unused=skip).backward()
                _loss(model, 100 + 10 * step + rank, skip_unused=skip).backward()
                reducer.finish(world_size=2)
                _loss(reference, 10 * step + rank, skip_unused=skip).backward()
                _loss(reference, 100 + 10 * step + rank, skip_unused=skip).backward()
                _reference_all_reduce(reference, 2, bucket_bytes)
                got = [p.grad.clone() for p in overlapped.parameters() if p.grad is not None]
                want = [p.grad.clone() for p in reference.parameters() if p.grad is not None]
                results[f"{bucket_bytes}/{step}"] = got + want
                for net in (overlapped, reference):
                    with torch.no_grad():
                        for p in net.parameters():
                            p -= 0.1 * p.grad  # type: ignore[operator]
                    net.zero_grad(set_to_none=True)
            results[f"{bucket_bytes}/stats"] = [torch.tensor([reducer.stats.overlapped, reducer.stats.at_boundary])]
            reducer.close()
        torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_two_ranks_get_the_post_backward_all_reduce_bit_for_bit(tmp_path: Path) -> None:
    start_ranks(_two_rank_worker, (str(tmp_path / "store"), str(tmp_path)), 2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for key, tensors in ranks[0].items():
        if key.endswith("/stats"):
            continue
        half = len(tensors) // 2
        got, want = tensors[:half], tensors[half:]
        assert half == 12  # 6 layers' weights and biases: every parameter has its average
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert g.dtype == w.dtype and torch.equal(g, w), f"{key}: parameter {i} differs from the reference"
        for i, (a, b) in enumerate(zip(tensors, ranks[1][key], strict=True)):
            assert torch.equal(a, b), f"{key}: tensor {i} differs between the ranks"
    small = ranks[0]["256/stats"][0].tolist()
    assert small[0] > 0, f"no bucket overlapped the backward pass on rank 0: {small}"


# -- CUDA: the hooks run on autograd's device thread and the buckets go through NCCL's stream --------------
@pytest.fixture
def nccl_world_1() -> Iterator[torch.device]:
    assert not dist.is_initialized(), "another test left a process group behind"
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    yield device
    dist.destroy_process_group()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.timeout(120)
@pytest.mark.parametrize("set_to_none", [True, False])
def test_on_cuda_the_overlapped_average_is_the_local_gradient_at_world_1(
    nccl_world_1: torch.device, set_to_none: bool
) -> None:
    """At world size 1 the average is the gradient itself: any race between the hooks' copies into the buckets
    (autograd's stream), NCCL's stream and the gradients left as the buckets' views (the next step's backward adding
    into them with ``set_to_none=False``) would show as a difference, over many steps and small buckets."""
    device = nccl_world_1
    net, reference = Net(mixed=True).to(device), Net(mixed=True).to(device)
    reducer = GradientReducer(net, bucket_bytes=256)
    model = LiveDataParallel(net, reducer)
    for step in range(20):
        g = torch.Generator(device=device).manual_seed(step)
        x, y = torch.randn(64, 16, device=device, generator=g), torch.randn(64, 1, device=device, generator=g)
        with model.no_sync():
            nn.functional.mse_loss(model(x[:32]), y[:32]).backward()
        nn.functional.mse_loss(model(x[32:]), y[32:]).backward()
        reducer.finish(world_size=1)
        nn.functional.mse_loss(reference(x[:32]), y[:32]).backward()
        nn.functional.mse_loss(reference(x[32:]), y[32:]).backward()
        for (name, p), q in zip(net.named_parameters(), reference.parameters(), strict=True):
            want = q.grad if q.grad is not None else torch.zeros_like(q)
            assert p.grad is not None and torch.equal(p.grad, want), f"step {step}: {name}"
        net.zero_grad(set_to_none=set_to_none)
        reference.zero_grad(set_to_none=set_to_none)
    assert reducer.stats.overlapped > 0
    reducer.close()
