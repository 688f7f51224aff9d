"""LR policy rules: exact values per world size, no compounding, warmup ramp, scheduler interplay."""

from __future__ import annotations

import math

import pytest
import torch

from elastic.contract.lr import LRPolicy, LRRule, scaled_lr


def _policy(rule: str, warmup: int = 0) -> LRPolicy:
    return LRPolicy(rule=LRRule(rule), base_lr=0.1, base_world_size=4, base_batch_per_worker=8, warmup_steps=warmup)


@pytest.mark.parametrize(
    ("rule", "expected"),
    [
        ("linear", {4: 0.1, 2: 0.1 * (2 / 4), 3: 0.1 * (3 / 4)}),
        ("sqrt", {4: 0.1, 2: 0.1 * math.sqrt(0.5), 3: 0.1 * math.sqrt(0.75)}),
        ("none", {4: 0.1, 2: 0.1, 3: 0.1}),
        ("fixed-global-batch", {4: 0.1, 2: 0.1, 3: 0.1}),
    ],
)
def test_lr_after_4_2_3_workers_is_the_rules_value_from_the_reference(rule: str, expected: dict[int, float]) -> None:
    p = _policy(rule)
    for world in (4, 2, 3):  # the sequence of resizes: computed from the reference each time
        assert p.target_lr(world) == expected[world]  # bit-equal to the documented formula


def test_fixed_global_batch_keeps_the_global_batch_by_accumulation() -> None:
    p = _policy("fixed-global-batch")
    assert [p.step_plan(w).global_batch for w in (4, 2, 3, 1)] == [32, 32, 32, 32]
    assert [p.step_plan(w).accumulation_steps for w in (4, 2, 3, 1)] == [1, 2, 2, 4]


def test_other_rules_grow_the_global_batch_with_the_world() -> None:
    assert [_policy("linear").step_plan(w).global_batch for w in (4, 2, 3)] == [32, 16, 24]


def test_warmup_ramps_linearly_from_old_to_new_factor() -> None:
    p = _policy("linear", warmup=4)
    ramp = p.start_ramp(step=100, current_factor=1.0, world_size=2)  # 4 -> 2 workers at step 100
    assert [p.factor_at(s, ramp) for s in range(100, 106)] == [0.875, 0.75, 0.625, 0.5, 0.5, 0.5]


def test_resize_during_a_ramp_starts_from_the_factor_in_force() -> None:
    p = _policy("linear", warmup=4)
    first = p.start_ramp(step=0, current_factor=1.0, world_size=2)
    mid = p.factor_at(1, first)  # 0.75 when the next resize lands
    second = p.start_ramp(step=2, current_factor=mid, world_size=3)
    assert p.factor_at(5, second) == 0.75 and p.factor_at(2, second) == 0.75
    assert second.target_factor == 0.75


def test_reference_round_trips() -> None:
    p = _policy("sqrt", warmup=3)
    assert LRPolicy.from_reference(p.reference()) == p


def test_scaled_lr_applies_the_factor_only_inside_the_block_so_schedulers_do_not_compound() -> None:
    w = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([w], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    seen = []
    for _ in range(3):
        with scaled_lr(opt, 2.0):
            seen.append(opt.param_groups[0]["lr"])
            opt.step()
        sched.step()
    assert seen == [0.2, 0.1, 0.05]
    assert opt.param_groups[0]["lr"] == 0.0125


def test_invalid_policy_values_are_rejected() -> None:
    with pytest.raises(ValueError):
        LRPolicy(rule=LRRule.LINEAR, base_lr=0, base_world_size=1, base_batch_per_worker=1)
    with pytest.raises(ValueError):
        LRPolicy(rule="cubic", base_lr=0.1, base_world_size=1, base_batch_per_worker=1)  # type: ignore[arg-type]
