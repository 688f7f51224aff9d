"""The loop never drains the device's queue at a step boundary: a step's loss is read through
:class:`~elastic.train.step_loss.StepLoss` (no scalar read of a tensor), and the boundary's agreements run over
:class:`~elastic.train.collectives.HostCollectives` (CPU tensors, a gloo group of their own beside NCCL).

On CPU the seam is the dispatcher: a scalar read of a tensor (``float(t)``, ``t.item()``: a stream sync on CUDA)
dispatches ``aten._local_scalar_dense``, which the trainer's steady-state steps must not call.  On a GPU
(``-m cuda``, in ``scripts/gpu_check.sh``) CUDA's own sync debug mode raises on any stream sync of the training
thread over the same steps."""

from __future__ import annotations

import time
import traceback
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import TensorDataset

import elastic
from elastic import compat
from elastic.contract.lr import LRPolicy, LRRule
from elastic.train.boundary import BoundaryFlags
from elastic.train.collectives import HostCollectives, mean_over_workers, takes_cpu_tensors, trains_on_cuda
from elastic.train.config import StepInfo
from elastic.train.step_loss import StepLoss
from elastic.train.trainer import ElasticConfig, ElasticTrainer

pytestmark = pytest.mark.timeout(60)

_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; torch.cuda.is_available() is False")


_LOOP_CODE = str(Path(elastic.__file__).parent)
_TORCH = str(Path(torch.__file__).parent)


def _plumbing(filename: str) -> bool:
    """A frame of torch's own dispatch machinery (a private module: ``_dynamo/``, ``_ops.py``, ...), which sits
    between the dispatch mode and the code that read a value."""
    return filename.startswith(_TORCH) and any(p.startswith("_") for p in Path(filename[len(_TORCH) :]).parts)


class _ScalarReads(TorchDispatchMode):
    """Records, while active, each read of a tensor's value on the host (``aten._local_scalar_dense``) by the
    loop's own code: the Python line that made it is in a module of ``elastic``.  (AdamW reads its step
    counters, CPU tensors on a GPU too: those are not the loop's, and not stream syncs.)"""

    def __init__(self) -> None:
        super().__init__()
        self.loop_reads: list[str] = []
        self.all_reads = 0
        self.callers: set[str] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default:
            self.all_reads += 1
            caller = next(
                f for f in reversed(traceback.extract_stack()) if f.filename != __file__ and not _plumbing(f.filename)
            )
            self.callers.add(caller.filename)
            if caller.filename.startswith(_LOOP_CODE):
                self.loop_reads.append(f"{caller.filename}:{caller.lineno} {caller.line}")
        return func(*args, **(kwargs or {}))


def _data(n: int = 400) -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, (x.sum(dim=1) > 0).long() + (x[:, 0] > 1).long())


def _train(
    device: torch.device, steps: int, watch_from: int, guard: Any, url: str | None = None, save_every: int | None = None
) -> tuple[list[StepInfo], list[list[torch.Tensor]], Any]:
    """Train a small MLP for ``steps`` steps (2 micro-batches each) with ``guard()`` entered from step
    ``watch_from`` on; the step records, each watched step's micro-batch losses (detached) and the guard."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    policy = LRPolicy(LRRule.FIXED_GLOBAL_BATCH, 0.01, 2, 4)  # one worker: 2 micro-batches of 4 per step
    config = ElasticConfig(policy, url, save_every_steps=save_every, progress_every=0)
    records: list[StepInfo] = []
    trainer = ElasticTrainer(model, optimizer, _data(), config, on_step=records.append)
    losses: list[list[torch.Tensor]] = []
    active = None
    try:
        for x, y in trainer.batches(epochs=10):
            if trainer.step >= steps:
                break
            if trainer.step == watch_from and active is None:
                active = guard()
                active.__enter__()
            loss = F.cross_entropy(trainer.model(x), y)
            if active is not None:
                if len(losses) < trainer.step + 1 - watch_from:
                    losses.append([])
                losses[-1].append(loss.detach().clone())
            trainer.backward(loss)
    finally:
        if active is not None:
            active.__exit__(None, None, None)
        trainer.close()
    return records, losses, active


def test_the_loops_steps_read_no_tensor_value_and_each_steps_loss_is_the_weighted_sum_of_its_micro_batches(
    gloo_world_1: None,
) -> None:
    records, losses, mode = _train(torch.device("cpu"), steps=8, watch_from=3, guard=_ScalarReads)
    assert any("/optim/" in c for c in mode.callers), f"the seam sees AdamW's step-counter reads: {mode.callers}"
    assert mode.loop_reads == [], "the loop read tensor values in steady-state steps"
    watched = [r for r in records if r.step > 3]
    assert [r.step for r in watched] == [4, 5, 6, 7, 8] and len(losses) == 5
    for record, micro in zip(watched, losses, strict=True):
        expected = 0.0
        for loss in micro:  # what float(loss) * weight summed over the micro-batches gives, bit for bit
            expected += float(loss) * 0.5
        assert record.loss == expected


def test_step_loss_sums_weighted_values_keeps_them_past_its_first_slots_and_starts_over_after_take() -> None:
    meter = StepLoss()
    assert meter.take() is None, "no micro-batch counted: no loss"
    values = [torch.tensor(0.1 * (i + 1), dtype=torch.float32) for i in range(20)]  # more than the first 8 slots
    for v in values:
        meter.add(v, 0.05)
    expected = 0.0
    for v in values:
        expected += float(v) * 0.05
    assert meter.take() == expected
    assert meter.take() is None
    meter.add(torch.tensor(2.0, dtype=torch.bfloat16), 1.0)
    meter.discard()
    assert meter.take() is None, "a discarded step counts nothing"


def test_step_loss_refuses_a_loss_of_more_than_one_value_naming_its_shape() -> None:
    with pytest.raises(ValueError, match=r"single value .* shape \(2, 3\)"):
        StepLoss().add(torch.zeros(2, 3), 1.0)


@pytest.mark.parametrize(
    ("backend", "cpu"),
    [
        ("gloo", True),
        ("nccl", False),
        ("cpu:gloo,cuda:nccl", True),
        ("cuda:nccl", False),
        ("mpi", True),
        ("undefined", True),
    ],
)
def test_which_default_groups_take_cpu_tensors_themselves(backend: str, cpu: bool) -> None:
    assert takes_cpu_tensors(backend) is cpu


@pytest.mark.parametrize(
    ("backend", "cuda_available", "cuda"),
    [
        ("nccl", True, True),
        ("gloo", True, False),
        ("cpu:gloo,cuda:nccl", True, True),
        ("cuda:nccl", True, True),
        ("CPU:gloo, CUDA:nccl", True, True),
        ("cpu:gloo,cuda:gloo", True, False),
        ("undefined", True, True),
        ("undefined", False, False),
        ("mpi", True, False),
    ],
)
def test_the_loop_trains_on_the_gpu_whenever_the_default_group_runs_cuda_tensors_over_nccl(
    backend: str, cuda_available: bool, cuda: bool
) -> None:
    """A script's own ``init_process_group("cpu:gloo,cuda:nccl")`` (or with no backend, on a GPU machine) trained
    on the CPU before: only a backend named exactly ``"nccl"`` meant the GPU."""
    assert trains_on_cuda(backend, cuda_available) is cuda


def test_over_a_gloo_group_no_group_of_its_own_is_made_and_restart_mode_agrees_on_cpu_tensors(
    gloo_world_1: None,
) -> None:
    for live in (False, True):
        host = HostCollectives.for_loop(torch.device("cpu"), timedelta(seconds=30), live=live)
        assert not host.separate and host.group() is None and host.groups_made == 0
    # restart mode: CPU tensors whatever the training device (a cpu:gloo,cuda:nccl group takes them itself)
    host = HostCollectives.for_loop(torch.device("meta"), timedelta(seconds=30), live=False)
    assert host.device == torch.device("cpu") and host.group() is None
    live = HostCollectives.for_loop(torch.device("meta"), timedelta(seconds=30), live=True)
    assert live.device == torch.device("meta"), "live mode keeps its agreements on the training device"


def test_a_separate_host_group_is_made_once_per_default_group_and_carries_the_boundary_flags(
    gloo_world_1: None,
) -> None:
    host = HostCollectives(torch.device("cpu"), timedelta(seconds=30), separate=True)
    assert host.groups_made == 1, "made at construction (every rank constructs it at the same point)"
    first = host.group()
    assert first is not None and host.group() is first and host.groups_made == 1
    assert dist.get_backend(first) == "gloo"
    flags = BoundaryFlags(time_due=True, writer_busy=True)
    assert flags.agree(host.device, first) == flags
    assert mean_over_workers({"loss": 2.5}, host.device, first) == {"loss": 2.5}
    compat.destroy_process_group()  # a new default group (a re-formed world): a new host group beside it
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    second = host.group()
    assert second is not first and host.groups_made == 2


def _two_ranks(rank: int, store_path: str, out: str) -> None:
    store = dist.FileStore(store_path, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    host = HostCollectives(torch.device("cpu"), timedelta(seconds=30), separate=True)
    mine = BoundaryFlags(signalled=rank == 1, local_due=rank == 0)
    agreed = mine.agree(host.device, host.group())
    mean = mean_over_workers({"x": float(rank)}, host.device, host.group())
    Path(out, f"rank{rank}").write_text(f"{agreed.encode()} {mean['x']}")
    compat.destroy_process_group()  # not dist's own: torch 2.6's gloo teardown can hang (see there)


@pytest.mark.timeout(120)
def test_two_ranks_agree_on_every_flag_either_of_them_set_over_their_separate_host_group(tmp_path: Path) -> None:
    ranks = mp.start_processes(
        _two_ranks, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, start_method="spawn", join=False
    )
    deadline = time.monotonic() + 90
    while not ranks.join(timeout=1):  # raises if a rank failed
        if time.monotonic() > deadline:
            for process in ranks.processes:
                process.kill()
            pytest.fail("the two ranks did not finish within 90 s")
    expected = f"{BoundaryFlags(signalled=True, local_due=True).encode()} 0.5"
    assert [(tmp_path / f"rank{r}").read_text() for r in (0, 1)] == [expected, expected]


# -- on a GPU (scripts/gpu_check.sh) -----------------------------------------------------------------------


class _NoStreamSync:
    """CUDA's sync debug mode at "error" while active: a stream sync of any thread raises."""

    def __enter__(self) -> _NoStreamSync:
        torch.cuda.set_sync_debug_mode("error")
        return self

    def __exit__(self, *exc: object) -> None:
        torch.cuda.set_sync_debug_mode("default")


@pytest.fixture
def nccl_world_1(tmp_path: Path) -> Iterator[torch.device]:
    assert not dist.is_initialized(), "another test left a process group behind"
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield torch.device("cuda", 0)
    if dist.is_initialized():
        compat.destroy_process_group()


@pytest.mark.cuda
@_CUDA
def test_on_a_gpu_the_loops_steady_steps_make_no_stream_sync(nccl_world_1: torch.device) -> None:
    records, losses, _ = _train(nccl_world_1, steps=12, watch_from=4, guard=_NoStreamSync)
    for record, micro in zip([r for r in records if r.step > 4], losses, strict=True):
        expected = 0.0
        for loss in micro:
            expected += float(loss) * 0.5
        assert record.loss == expected


@pytest.mark.cuda
@_CUDA
def test_on_a_gpu_a_snapshot_boundary_after_warm_up_makes_no_stream_sync(
    nccl_world_1: torch.device, tmp_path: Path
) -> None:
    # the first boundary warms the stager up (buffers); from step 3 on, steps 4 and 8 save (every 4 steps)
    records, _, _ = _train(
        nccl_world_1, steps=10, watch_from=3, guard=_NoStreamSync, url=str(tmp_path / "ck"), save_every=4
    )
    assert [r.step for r in records][-1] == 10
    from elastic.checkpoint import create_checkpoint_manager

    assert [s.step for s in create_checkpoint_manager(str(tmp_path / "ck")).list_snapshots()][-2:] == [4, 8]
