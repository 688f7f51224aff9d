"""Run under torchrun (2 ranks, gloo): sharded DTensor state saved and loaded through the manager.

argv: URL OUT_DIR STORAGE_OPTIONS_JSON.  Each rank writes OUT_DIR/rank<r>.json with what it observed.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from elastic import compat
from elastic.checkpoint import CheckpointOptions, StateLayout, create_checkpoint_manager
from elastic.checkpoint.layout import step_dir
from elastic.interpreter import freeze_at_exit


def full_state(step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 8, generator=gen), "b": torch.randn(5, generator=gen).to(torch.bfloat16)}


def main() -> None:
    url, out_dir, storage_options = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def sharded(step: int) -> dict[str, object]:
        full = full_state(step)
        return {
            "w": distribute_tensor(full["w"], mesh, [Shard(0)]),
            "b": full["b"],
            "cursor": {"epoch": step},
        }

    options = CheckpointOptions(layout=StateLayout.SHARDED, storage_options=storage_options, keep_last=3)
    mgr = create_checkpoint_manager(url, options)
    mgr.save(1, sharded(1), blocking=True)
    mgr.save(2, sharded(2), blocking=False)  # DCP async save under our manifest
    mgr.wait()

    def template() -> dict[str, object]:
        zeros = {"w": torch.zeros(64, 8), "b": torch.zeros(5, dtype=torch.bfloat16)}
        return {
            "w": distribute_tensor(zeros["w"], mesh, [Shard(0)]),
            "b": zeros["b"],
            "cursor": {"epoch": -1},
        }

    result: dict[str, object] = {"rank": rank}
    snap = mgr.load_latest(template=template())
    assert snap is not None
    expected = sharded(2)
    result["latest_step"] = snap.step
    result["latest_equal"] = bool(
        torch.equal(snap.state["w"].to_local(), expected["w"].to_local())  # type: ignore[attr-defined]
        and torch.equal(snap.state["b"], expected["b"])  # type: ignore[arg-type]
        and snap.state["cursor"] == {"epoch": 2}
    )
    dist.barrier()
    if rank == 0:  # corrupt one byte of one shard file of step 2
        manifest = mgr.list_snapshots()[-1].manifest
        shard = next(f for f in manifest.files if f.path.endswith(".distcp"))
        path = mgr.storage.full_path(f"{step_dir(2)}/{shard.path}")
        import fsspec

        with fsspec.open(path, "rb", **storage_options) as f:
            data = bytearray(f.read())
        data[len(data) // 2] ^= 0xFF
        with fsspec.open(path, "wb", **storage_options) as f:
            f.write(bytes(data))
    dist.barrier()
    fallback = mgr.load_latest(template=template())
    assert fallback is not None
    expected1 = sharded(1)
    result["fallback_step"] = fallback.step
    result["fallback_equal"] = bool(
        torch.equal(fallback.state["w"].to_local(), expected1["w"].to_local())  # type: ignore[attr-defined]
        and fallback.state["cursor"] == {"epoch": 1}
    )
    mgr.close()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    compat.destroy_process_group()


if __name__ == "__main__":
    freeze_at_exit()  # exit skips the collector's pass over torch's objects (elastic.interpreter)
    main()
