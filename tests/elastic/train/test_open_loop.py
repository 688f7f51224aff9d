"""The open loop: the script's own optimizer step (GradScaler, clipping, several optimizers, a skipped step), its
own DataLoader, its own state in the snapshots, and max_steps; one real rank (a gloo group of one) per test,
two for the disagreement between ranks."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from elastic import compat
from elastic.checkpoint.layout import step_dir
from elastic.contract.lr import LRPolicy, LRRule
from elastic.train.batch_sampler import ElasticBatchSampler
from elastic.train.config import StepInfo
from elastic.train.registry import RegistrationError
from elastic.train.step import StepMismatchError
from elastic.train.trainer import ElasticConfig, ElasticTrainer
from tests.ranks import PRELOAD, start_ranks

pytestmark = pytest.mark.timeout(90)


def _data(n: int = 48) -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(n, 6, generator=g)
    return TensorDataset(x, (x.sum(dim=1) > 0).long(), torch.arange(n))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _policy(**kw: Any) -> LRPolicy:
    return LRPolicy(kw.pop("rule", LRRule.NONE), 0.05, 1, 4, accumulation_steps=kw.pop("accumulation", 2), **kw)


def _params(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


class _Counter:
    def __init__(self) -> None:
        self.value = 0

    def state_dict(self) -> dict[str, int]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.value = int(state["value"])


def test_the_own_step_form_trains_exactly_as_the_short_form(gloo_world_1: None) -> None:
    """Same data, same micro-batches (2 per step), same weights: the script's own step is the loop's step."""
    results = []
    for own in (False, True):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        records: list[StepInfo] = []
        config = ElasticConfig(_policy(), progress_every=0)
        trainer = ElasticTrainer(model, opt, _data(), config, on_step=records.append)
        if own:
            for step in trainer.steps(max_steps=5):
                assert step.index == trainer.step + 1 and step.accumulation == 2
                for x, y, _ in step:
                    (F.cross_entropy(trainer.model(x), y) * step.weight).backward()
                opt.step()
        else:
            for x, y, _ in trainer.batches(max_steps=5):
                trainer.backward(F.cross_entropy(trainer.model(x), y))
        results.append((_params(trainer.module), [list(r.indices) for r in records]))
        trainer.close()
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    (short_params, short_idx), (own_params, own_idx) = results
    assert own_idx == short_idx and len(own_idx) == 5
    assert all(torch.equal(a, b) for a, b in zip(short_params, own_params, strict=True))


def test_gradscaler_clipping_and_bf16_autocast_run_in_the_scripts_step_with_the_lr_factor_around_it(
    gloo_world_1: None,
) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    policy = LRPolicy(LRRule.LINEAR, 0.05, 4, 4)  # a world of 1 where 4 was planned: factor 0.25
    trainer = ElasticTrainer(model, opt, _data(), ElasticConfig(policy, progress_every=0), state={"scaler": scaler})
    seen_lr: list[float] = []
    opt.register_step_pre_hook(lambda o, a, k: seen_lr.append(o.param_groups[0]["lr"]))
    for step in trainer.steps(max_steps=3):
        for x, y, _ in step:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(trainer.model(x), y)
            step.backward(loss, scaler)
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(trainer.module.parameters(), 0.5)
        before = _params(trainer.module)
        scaler.step(opt)
        scaler.update()
        after = _params(trainer.module)
        assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert seen_lr == [pytest.approx(0.0125)] * 3, "the LR factor applies inside the optimizer's step"
    assert opt.param_groups[0]["lr"] == 0.05, "and the script's own LR is back after it"
    assert trainer.step == 3
    trainer.close()


def test_a_step_skipped_on_every_rank_commits_and_moves_nothing(gloo_world_1: None) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    records: list[StepInfo] = []
    trainer = ElasticTrainer(model, opt, _data(), ElasticConfig(_policy(), progress_every=0), on_step=records.append)
    start = _params(trainer.module)
    for step in trainer.steps(max_steps=2):
        for x, y, _ in step:
            step.backward(F.cross_entropy(trainer.model(x), y))
        if step.index == 2:
            opt.step()
    assert trainer.step == 2 and [r.step for r in records] == [1, 2]
    trainer.close()
    assert any(not torch.equal(a, b) for a, b in zip(start, _params(model), strict=True))


def test_registered_state_scheduler_and_a_second_optimizer_resume_bit_identical_and_max_steps_saves_the_last(
    gloo_world_1: None, tmp_path: Path
) -> None:
    url = str(tmp_path / "ck")

    def run(max_steps: int) -> tuple[ElasticTrainer, dict[str, Any]]:
        model = _model()
        first, second = model[0], model[2]
        opt_a = torch.optim.AdamW(first.parameters(), lr=0.05)
        opt_b = torch.optim.SGD(second.parameters(), lr=0.05, momentum=0.9)
        ema = torch.optim.swa_utils.AveragedModel(model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
        counter = _Counter()
        config = ElasticConfig(_policy(), url, save_every_steps=3, progress_every=0)
        trainer = ElasticTrainer(model, [opt_a, opt_b], _data(), config, state={"ema": ema})
        sched = torch.optim.lr_scheduler.StepLR(opt_a, step_size=2, gamma=0.5)  # made after the trainer
        trainer.register_state("counter", counter)
        trainer.register_state("sched", sched)
        for step in trainer.steps(max_steps=max_steps):
            for x, y, _ in step:
                step.backward(F.cross_entropy(trainer.model(x), y))
            opt_a.step()
            opt_b.step()
            sched.step()
            ema.update_parameters(trainer.module)
            counter.value += 1
        return trainer, {
            "model": _params(model),
            "ema": _params(ema),
            "a": opt_a.state_dict(),
            "b": opt_b.state_dict(),
            "counter": counter.value,
            "lr": opt_a.param_groups[0]["lr"],
        }

    straight, expected = run(7)
    assert (Path(url) / step_dir(7)).is_dir(), "max_steps took a final snapshot of step 7"
    straight.close()
    import shutil

    shutil.rmtree(url)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    first, _ = run(4)  # saved at 3 (schedule) and 4 (max_steps)
    first.close()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    resumed, got = run(7)
    assert resumed.resumed_from == "durable"
    resumed.close()
    assert got["counter"] == expected["counter"] == 7 and got["lr"] == expected["lr"]
    for key in ("model", "ema"):
        assert all(torch.equal(a, b) for a, b in zip(expected[key], got[key], strict=True)), key
    for key in ("a", "b"):
        for pid, state in expected[key]["state"].items():
            for name, value in state.items():
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(got[key]["state"][pid][name])), (key, name)


def test_bad_registrations_are_clear_errors(gloo_world_1: None) -> None:
    trainer = ElasticTrainer(
        _model(), torch.optim.SGD(_model().parameters(), lr=0.05), _data(), ElasticConfig(_policy(), progress_every=0)
    )
    with pytest.raises(RegistrationError, match="has no load_state_dict"):
        trainer.register_state("x", type("OnlySave", (), {"state_dict": lambda self: {}})())
    trainer.register_state("c", _Counter())
    with pytest.raises(RegistrationError, match="registered already"):
        trainer.register_state("c", _Counter())
    for step in trainer.steps(max_steps=1):
        for x, y, _ in step:
            step.backward(F.cross_entropy(trainer.model(x), y))
    with pytest.raises(RegistrationError, match="after the first step"):
        trainer.register_state("late", _Counter())
    trainer.close()


def _loader_records(workers: int) -> Iterator[list[int]]:
    ds = _data(40)
    # workers from the forkserver: a fork of this pytest process, whose thread pools other tests used, can crash
    multiprocessing.set_forkserver_preload(PRELOAD)
    context = "forkserver" if workers else None
    loader = DataLoader(
        ds,
        batch_sampler=ElasticBatchSampler(ds, seed=5),
        num_workers=workers,
        persistent_workers=workers > 0,
        multiprocessing_context=context,
    )
    model = _model()
    records: list[StepInfo] = []
    config = ElasticConfig(_policy(accumulation=3), progress_every=0)
    trainer = ElasticTrainer(
        model, torch.optim.SGD(model.parameters(), lr=0.05), loader, config, on_step=records.append
    )
    served: list[int] = []
    for step in trainer.steps(epochs=2):
        for x, y, ids in step:
            served.extend(ids.tolist()[: len(step.indices)])
            step.backward(F.cross_entropy(trainer.model(x), y))
        trainer.optimizer.step()
    trainer.close()
    yield from ([int(i) for i in r.indices] for r in records)
    yield served


def test_a_dataloader_with_two_persistent_workers_serves_every_sample_once_per_epoch_as_in_process_collation(
    gloo_world_1: None,
) -> None:
    with_workers = list(_loader_records(2))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    in_process = list(_loader_records(0))
    assert with_workers == in_process
    served = with_workers[-1]
    assert sorted(served) == sorted(list(range(40)) * 2), "each sample once per epoch, two epochs"


def _mismatch_rank(rank: int, store_path: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    trainer = ElasticTrainer(model, opt, _data(), ElasticConfig(_policy(), progress_every=0))
    expected = r"step 1: the optimizer\(s\) stepped 0 time\(s\) on some ranks and 1 on others"
    with pytest.raises(StepMismatchError, match=expected):
        for step in trainer.steps(max_steps=3):
            for x, y, _ in step:
                step.backward(F.cross_entropy(trainer.model(x), y))
            if rank == 0 or step.index > 1:  # e.g. a skip decided on this rank's own loss
                opt.step()
    # DDP's boundary agreement overlaps the next step (elastic.train.agreement): step 1's is read at step 2's boundary
    assert trainer.step == 2, "step 1's mismatch is refused at the next boundary, on both ranks"
    compat.destroy_process_group()


def test_an_optimizer_step_skipped_on_one_rank_only_is_an_error_on_every_rank(tmp_path: Path) -> None:
    start_ranks(_mismatch_rank, (str(tmp_path / "store"),), nprocs=2)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; torch.cuda.is_available() is False")
def test_on_cuda_the_own_step_with_fp16_gradscaler_and_a_pinned_two_worker_loader_trains_and_resumes_its_scaler(
    tmp_path: Path,
) -> None:
    """A world of one over NCCL (no torchrun): the script's DataLoader (pinned memory, 2 workers) feeds the GPU,
    fp16 autocast with a GradScaler in the script's step; the scaler's state comes back on resume."""
    multiprocessing.set_forkserver_preload(PRELOAD)
    url = str(tmp_path / "ck")
    scales = []
    for max_steps in (4, 8):
        ds = _data(64)
        loader = DataLoader(
            ds,
            batch_sampler=ElasticBatchSampler(ds, seed=1),
            num_workers=2,
            pin_memory=True,
            persistent_workers=True,
            multiprocessing_context="forkserver",
        )
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10, growth_interval=2)
        config = ElasticConfig(_policy(), url, save_every_steps=2, progress_every=0)
        trainer = ElasticTrainer(model, opt, loader, config, state={"scaler": scaler})
        assert trainer.device.type == "cuda"
        if max_steps == 8:
            assert scaler.get_scale() == scales[-1], "the scaler's scale came back from the snapshot"
        for step in trainer.steps(max_steps=max_steps):
            for x, y, _ in step:
                assert x.is_cuda
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = F.cross_entropy(trainer.model(x), y)
                step.backward(loss, scaler)
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(trainer.module.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
        scales.append(scaler.get_scale())
        trainer.close()
    assert scales[0] > 2.0**10, "the scale grew every 2 finite steps"


def _draws(url: str, max_steps: int) -> list[float]:
    ds = _data(40)
    loader = DataLoader(ds, batch_sampler=ElasticBatchSampler(ds, seed=2))
    model = _model()
    trainer = ElasticTrainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.05),
        loader,
        ElasticConfig(_policy(), url, save_every_steps=3, progress_every=0),
    )
    drawn = []
    for step in trainer.steps(max_steps=max_steps):
        for x, y, _ in step:
            step.backward(F.cross_entropy(F.dropout(trainer.model(x), 0.2), y))
        trainer.optimizer.step()
        drawn.append(float(torch.rand(())))  # what a script draws (noise, dropout masks)
    trainer.close()
    return drawn


def test_a_resume_with_a_dataloader_draws_the_same_random_numbers_as_an_uninterrupted_run(
    gloo_world_1: None, tmp_path: Path
) -> None:
    """A DataLoader iterator draws its workers' base seed from torch's global generator, and a resumed run makes one
    more iterator than an uninterrupted one: before, every draw after the resume differed."""
    straight = _draws(str(tmp_path / "a"), 6)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    first = _draws(str(tmp_path / "b"), 3)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    rest = _draws(str(tmp_path / "b"), 6)
    assert first + rest == straight
