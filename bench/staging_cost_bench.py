"""The host's cost of a snapshot's save call against the number of tensors in the state (issue 29).

On a GPU the save call of the loop (``save(state, overlap_with=optimizer)``) only queues copies; what it costs the
host is Python: the state's capture, the plan of which tensors go device-side, and one queued copy per tensor.
That cost grows with the number of tensors, and a model with hundreds of parameters has thousands of state tensors
with AdamW's moments.  This runs the stager of the replicated layout (``elastic/checkpoint/staging.py``) on the CPU
with in-memory device memory (``HostDeviceMemory``) and copy streams that only count the copies queued (the
figure is the stager's own Python; CUDA's cost of queuing each copy, about 10-25 us, comes on top of it): every
tensor is device-staged, as on a GPU with memory to spare.  Every tensor of the state is the optimizer's
(parameters and moments of an MLP without buffers), so, as with the loop's ``overlap_with=optimizer``, all of them
are fenced at the next optimizer step, not at once.

For each size: an MLP of ``n / 2`` ``Linear(32, 32)`` layers (``n`` parameter tensors, ``3 n`` state tensors with
AdamW), the median over ``--repeats`` warm saves of the capture and of the staging call (the first save, which
allocates, is left out).  Prints a table and writes JSON (default bench/results/staging_cost.json).

    python bench/staging_cost_bench.py [--sizes 300,900,2700,5400] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from elastic.checkpoint.device_staging import DeviceBufferPool, DeviceStagingSettings, HostDeviceMemory  # noqa: E402
from elastic.checkpoint.staging import Stager  # noqa: E402
from elastic.checkpoint.state import capture_training_state  # noqa: E402


class _Done:
    def wait(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _CountingCopyOps:
    """Copy streams that queue nothing: every tensor is on "device 0", each copy is counted, events are done."""

    needs_pinned_host = False

    def __init__(self) -> None:
        self.copies = 0

    def device_of(self, tensor: torch.Tensor) -> int | None:
        return 0

    def begin(self, device: int) -> None:
        pass

    def copy_all(self, device: int, copies: Sequence[Any], *, phase: str) -> None:
        self.copies += len(copies)

    def record(self, device: int) -> _Done:
        return _Done()

    def order_after(self, device: int, event: Any) -> None:
        pass


def measure(params: int, repeats: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(params // 2)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 32)).sum().backward()
    optimizer.step()  # AdamW's moments exist from the first step on
    ops = _CountingCopyOps()
    pool = DeviceBufferPool(HostDeviceMemory(1 << 40), DeviceStagingSettings(margin_bytes=0, margin_fraction=0.0))
    stager = Stager(pinned_limit_bytes=0, ops=ops, device_pool=pool)  # type: ignore[arg-type]
    capture_s: list[float] = []
    stage_s: list[float] = []
    tensors = 0
    for step in range(repeats + 1):
        start = time.perf_counter()
        state = capture_training_state(step, model, optimizer, gather_rng=False).to_dict()
        captured = time.perf_counter()
        flat = stager.flatten(state, copy=True, defer=lambda _t: True)  # as overlap_with=optimizer does
        staged = time.perf_counter()
        flat.finish_staging()
        tensors = len(flat.tensors)
        if step:  # the first save allocates every buffer
            capture_s.append(captured - start)
            stage_s.append(staged - captured)
    return {
        "parameters": params,
        "state_tensors": tensors,
        "capture_s": capture_s,
        "staging_call_s": stage_s,
        "copies_queued_per_save": ops.copies // (repeats + 1),
        "staging_call_median_s": statistics.median(stage_s),
        "capture_median_s": statistics.median(capture_s),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="300,900,2700,5400", help="parameter tensors per model, comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "staging_cost.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = [measure(int(n), args.repeats) for n in args.sizes.split(",")]
    print(f"{'parameters':>10} {'state tensors':>14} {'capture ms':>11} {'staging call ms':>16} {'us per tensor':>14}")
    for r in rows:
        per = r["staging_call_median_s"] / max(1, r["state_tensors"]) * 1e6
        print(
            f"{r['parameters']:>10} {r['state_tensors']:>14} {r['capture_median_s'] * 1e3:>11.1f} "
            f"{r['staging_call_median_s'] * 1e3:>16.1f} {per:>14.1f}"
        )
    report = {"machine": {"platform": platform.platform(), "torch": torch.__version__}, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"medians over {args.repeats} warm saves each; wrote {args.out}")


if __name__ == "__main__":
    main()
