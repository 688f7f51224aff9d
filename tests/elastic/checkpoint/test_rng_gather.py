"""RNG states are gathered from every rank as packed tensors (no pickling) and restore exactly."""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from elastic.checkpoint.state import _pack_rng, _unpack_rng, capture_rng_state, restore_rng_state

pytestmark = pytest.mark.timeout(120)


def _draws() -> tuple[list[float], list[float], list[float]]:
    return torch.rand(3).tolist(), np.random.rand(3).tolist(), [random.random() for _ in range(3)]


@pytest.mark.parametrize("gauss_pending", [False, True])
def test_packed_rng_state_unpacks_to_the_same_draws(gauss_pending: bool) -> None:
    torch.manual_seed(3)
    np.random.seed(4)
    random.seed(5)
    if gauss_pending:  # python and numpy then hold a cached gaussian: part of the state
        random.gauss(0, 1)
        np.random.standard_normal()
    state = capture_rng_state()
    expected = _draws()
    restore_rng_state(_unpack_rng(_pack_rng(state)))
    assert _draws() == expected


def test_two_ranks_gather_each_others_rng_states(tmp_path: Path) -> None:
    script = tmp_path / "gather.py"
    script.write_text(
        textwrap.dedent("""
        import random, sys
        import numpy as np, torch, torch.distributed as dist
        from elastic import compat
        from elastic.checkpoint.state import capture_training_state, restore_rng_state
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        model = torch.nn.Linear(2, 2)  # built before seeding: its init draws from torch's RNG
        torch.manual_seed(10 + rank); np.random.seed(20 + rank); random.seed(30 + rank)
        state = capture_training_state(0, model)
        other = 1 - rank
        torch.manual_seed(10 + other); np.random.seed(20 + other); random.seed(30 + other)
        expected = (torch.rand(2).tolist(), np.random.rand(2).tolist(), random.random())
        restore_rng_state(state.rng[other])
        got = (torch.rand(2).tolist(), np.random.rand(2).tolist(), random.random())
        assert sorted(state.rng) == [0, 1] and got == expected, (got, expected)
        print("ok", rank)
        compat.destroy_process_group()
    """)
    )
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)]
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}
    import os

    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=100, env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("ok") == 2, proc.stdout
