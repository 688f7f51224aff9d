"""The Hugging Face adapters in this process, a world of one (the real Trainer, Accelerator and checkpoint manager;
no torchrun): a run stopped at a step and started again resumes from its snapshot on its own, serving the samples
the uninterrupted run serves at each step and ending bit-identical to it. Under torchrun with kills and resizes:
test_hf_trainer.py."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

for _name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ.setdefault(_name, "1")

from elastic.contract.lr import LRPolicy, LRRule  # noqa: E402
from elastic.train.config import StepInfo  # noqa: E402
from tests.integrations.hf_worker import Sequences, make_model  # noqa: E402

SAMPLES, BATCH, ACCUMULATION, BASE_WORLD, LR = 40, 2, 2, 2, 3e-3
POLICY = LRPolicy(LRRule.FIXED_GLOBAL_BATCH, LR, BASE_WORLD, BATCH, accumulation_steps=ACCUMULATION)


def _params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _trainer_run(
    tmp: Path, ck: Path, max_steps: int, sigterm_at: int = 0, save_every: int = 4
) -> tuple[dict[str, torch.Tensor], list[StepInfo]]:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from elastic.integrations.hf import make_elastic

    steps: list[StepInfo] = []
    args = TrainingArguments(
        output_dir=str(tmp / "hf-out"),
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=ACCUMULATION,
        learning_rate=LR,
        max_steps=max_steps,
        lr_scheduler_type="constant",
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        logging_steps=1000,
    )
    trainer = Trainer(model=make_model(0), args=args, train_dataset=Sequences(SAMPLES))
    make_elastic(
        trainer, checkpoint_url=str(ck), base_world_size=BASE_WORLD, save_every_steps=save_every, on_step=steps.append
    )

    class Notice(TrainerCallback):
        def on_optimizer_step(self, *args: Any, **kwargs: Any) -> None:  # inside the step, before its boundary
            if len(steps) + 1 == sigterm_at:
                os.kill(os.getpid(), signal.SIGTERM)

    trainer.add_callback(Notice())
    assert args.gradient_accumulation_steps == ACCUMULATION * BASE_WORLD  # a world of one runs both ranks' share
    trainer.train()
    return _params(trainer.accelerator.unwrap_model(trainer.model_wrapped)), steps


def _accelerate_run(
    ck: Path, max_steps: int, sigterm_at: int = 0, save_every: int = 4
) -> tuple[dict[str, torch.Tensor], list[StepInfo]]:
    from accelerate import Accelerator

    from elastic.integrations.accelerate import ElasticAccelerate

    steps: list[StepInfo] = []
    data = Sequences(SAMPLES)
    accelerator = Accelerator(cpu=True)
    model = make_model(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    model, optimizer = accelerator.prepare(model, optimizer)
    elastic = ElasticAccelerate(
        accelerator,
        model,
        optimizer,
        data,
        POLICY,
        checkpoint_url=str(ck),
        scheduler=scheduler,
        save_every_steps=save_every,
        on_step=steps.append,
    )
    loader = torch.utils.data.DataLoader(data, batch_sampler=elastic.batch_sampler)
    for step in elastic.steps(loader, max_steps=max_steps):
        assert step.accumulation == ACCUMULATION * BASE_WORLD
        for batch in step:
            step.backward(model(**batch).loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        if step.index == sigterm_at:
            os.kill(os.getpid(), signal.SIGTERM)  # a preemption notice in the middle of training
    return _params(accelerator.unwrap_model(model)), steps


def _assert_resumed_as_uninterrupted(whole: Any, first: Any, second: Any, stop: int, total: int) -> None:
    (ref, ref_steps), (_, head), (params, tail) = whole, first, second
    assert [s.step for s in head] == list(range(1, stop + 1))
    assert [s.step for s in tail] == list(range(stop + 1, total + 1)), "resumed from the snapshot of the stop"
    assert [list(s.indices) for s in head + tail] == [list(s.indices) for s in ref_steps]
    assert [s.lr for s in head + tail] == [s.lr for s in ref_steps]
    assert ref.keys() == params.keys()
    for k in ref:
        assert torch.equal(ref[k], params[k]), k


@pytest.mark.timeout(120)
def test_trainer_stopped_and_started_again_resumes_by_itself_bit_identical(tmp_path: Path, gloo_world_1: None) -> None:
    whole = _trainer_run(tmp_path, tmp_path / "ck-whole", 14)  # 40 samples, 8 a step: 5 steps an epoch
    first = _trainer_run(tmp_path, tmp_path / "ck", 7)
    second = _trainer_run(tmp_path, tmp_path / "ck", 14)  # no resume_from_checkpoint: the newest snapshot
    _assert_resumed_as_uninterrupted(whole, first, second, 7, 14)
    params, steps = _trainer_run(tmp_path, tmp_path / "ck", 14)  # started again after its end: nothing to do
    assert steps == []
    for k, v in params.items():
        assert torch.equal(v, whole[0][k]), k


@pytest.mark.timeout(120)
def test_accelerate_loop_stopped_and_started_again_resumes_by_itself_bit_identical(
    tmp_path: Path, gloo_world_1: None
) -> None:
    whole = _accelerate_run(tmp_path / "ck-whole", 14)
    first = _accelerate_run(tmp_path / "ck", 7)
    second = _accelerate_run(tmp_path / "ck", 14)
    _assert_resumed_as_uninterrupted(whole, first, second, 7, 14)
    params, steps = _accelerate_run(tmp_path / "ck", 14)  # started again after its end: nothing to do
    assert steps == []
    for k, v in params.items():
        assert torch.equal(v, whole[0][k]), k


@pytest.mark.timeout(120)
def test_trainer_sigterm_saves_the_step_at_the_boundary_and_exits_143(tmp_path: Path, gloo_world_1: None) -> None:
    """The Trainer's form of the test below: SIGTERM during step 6, saved at its boundary, exit 143, resumed at 7."""
    whole = _trainer_run(tmp_path, tmp_path / "ck-whole", 10, save_every=100)
    with pytest.raises(SystemExit) as stopped:
        _trainer_run(tmp_path, tmp_path / "ck", 10, sigterm_at=6, save_every=100)
    assert stopped.value.code == 143
    saved = sorted(p.parent.name for p in (tmp_path / "ck").glob("step-*/manifest.json"))
    assert saved == ["step-000000000005", "step-000000000006"], saved  # the epoch's end (5 steps), and the notice
    params, tail = _trainer_run(tmp_path, tmp_path / "ck", 10, save_every=100)
    assert [s.step for s in tail] == [7, 8, 9, 10]
    assert [list(s.indices) for s in tail] == [list(s.indices) for s in whole[1][6:]]
    for k, v in params.items():
        assert torch.equal(v, whole[0][k]), k


@pytest.mark.timeout(120)
def test_accelerate_loop_sigterm_saves_the_step_at_the_boundary_and_exits_143(
    tmp_path: Path, gloo_world_1: None
) -> None:
    """SIGTERM during step 6 (no snapshot due but the first epoch's end, step 5): the step is saved at its
    boundary, the run exits 143; started again, it resumes at step 7 and ends bit-identical to an uninterrupted run."""
    whole = _accelerate_run(tmp_path / "ck-whole", 10)
    with pytest.raises(SystemExit) as stopped:
        _accelerate_run(tmp_path / "ck", 10, sigterm_at=6, save_every=100)
    assert stopped.value.code == 143
    saved = sorted(p.parent.name for p in (tmp_path / "ck").glob("step-*/manifest.json"))
    assert saved == ["step-000000000005", "step-000000000006"], saved  # the epoch's end (5 steps), and the notice
    params, tail = _accelerate_run(tmp_path / "ck", 10, save_every=100)
    assert [s.step for s in tail] == [7, 8, 9, 10]
    assert [list(s.indices) for s in tail] == [list(s.indices) for s in whole[1][6:]]
    for k, v in params.items():
        assert torch.equal(v, whole[0][k]), k
