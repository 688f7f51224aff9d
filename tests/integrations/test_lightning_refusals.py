"""What ElasticDDPStrategy refuses, each with a message naming the fix (a world of one, in a subprocess: Lightning's
fit leaves its process group behind, which the suite's other tests must not inherit)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("lightning") is None, reason="needs elastic-train[lightning]")

SCRIPT = textwrap.dedent("""
    import json, sys, warnings
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, IterableDataset, TensorDataset
    sys.path.insert(0, sys.argv[2])
    from lightning_worker import TinyNet, make_dataset
    from elastic.contract.lr import LRPolicy
    from elastic.integrations.lightning import ElasticDDPStrategy
    from elastic.train.config import ElasticConfig

    url = sys.argv[1]
    policy = LRPolicy("fixed-global-batch", 0.05, 1, 4)
    out = {}

    def fit(name, strategy, loader=None, **kw):  # the trainer, and what it raised (or "ran") in out[name]
        model = TinyNet(0.05, 0, 0.0, data=make_dataset(16), batch=4)
        trainer = L.Trainer(accelerator="cpu", max_epochs=1, strategy=strategy, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            **kw.pop("trainer", {}))
        try:
            trainer.fit(model, loader, **kw)
            out[name] = "ran"
        except (ValueError, TypeError) as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
        return trainer

    class Stream(IterableDataset):
        def __iter__(self):
            yield from make_dataset(16)

    try:
        ElasticDDPStrategy(ElasticConfig(policy, url, recovery="live"))
    except ValueError as exc:
        out["live"] = str(exc)
    fit("batch", ElasticDDPStrategy(policy, url), DataLoader(make_dataset(16), batch_size=8, shuffle=True))
    fit("stream", ElasticDDPStrategy(policy, url), DataLoader(Stream(), batch_size=4))
    fit("limit", ElasticDDPStrategy(policy, url), trainer={"limit_train_batches": 2})
    fit("accumulate", ElasticDDPStrategy(policy, url), trainer={"accumulate_grad_batches": 3})
    fit("fresh", ElasticDDPStrategy(policy, url)).save_checkpoint(url + "/lightning.ckpt")
    fit("ckpt", ElasticDDPStrategy(policy, url), ckpt_path=url + "/lightning.ckpt")
    print(json.dumps(out))
""")


@pytest.mark.slow  # ≈ 25 s, most of it Lightning's import
@pytest.mark.timeout(180)
def test_lightning_strategy_refuses_what_it_cannot_keep_exactly_once(tmp_path: Path) -> None:
    worker_dir = str(Path(__file__).parent)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETRAIN_")}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "ck"), worker_dir],
        capture_output=True,
        text=True,
        timeout=170,
        env={**env, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert "Lightning forms and owns the process group" in out["live"]
    assert "batch_size=8 differs from the LR policy's base_batch_per_worker=4" in out["batch"]
    assert out["stream"].startswith("TypeError: an IterableDataset")
    assert "limit_train_batches" in out["limit"]
    assert "accumulate_grad_batches=3" in out["accumulate"]
    assert out["fresh"] == "ran"
    assert "leave ckpt_path out" in out["ckpt"]
