"""The benchmarks' model: an MLP and its optimizer on a device, sized by the bytes of state it holds.

State = parameters + optimizer state: 2x the parameters with SGD + momentum, 3x with AdamW (plus a few
scalars).  A step is forward + backward + ``optimizer.step()``; on CUDA every timed section ends with a
``torch.cuda.synchronize()`` so that it measures the GPU's work, not the time to queue it.
"""

from __future__ import annotations

import time
from typing import Any

import torch

MiB = 2**20
GiB = 2**30


def state_bytes(state: Any) -> int:
    """Bytes of every tensor in a nested dict/list/tuple."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(v) for v in state)
    return 0


def pick_device(name: str) -> torch.device:
    if name == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device here (torch.cuda.is_available() is False)")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Workload:
    """An MLP of ``width``-wide square layers whose state adds up to about ``target_bytes``."""

    def __init__(
        self,
        target_bytes: int,
        device: torch.device,
        optimizer: str = "sgd",
        width: int | None = None,
        batch: int | None = None,
    ) -> None:
        torch.manual_seed(0)
        self.device = device
        cuda = device.type == "cuda"
        self.width = width or (8192 if cuda else 2048)
        self.batch = batch or (1024 if cuda else 16)
        copies = 3 if optimizer == "adamw" else 2
        layers = max(1, round(target_bytes / copies / (self.width * self.width * 4)))
        self.model = torch.nn.Sequential(*[torch.nn.Linear(self.width, self.width) for _ in range(layers)]).to(device)
        if optimizer == "adamw":
            self.optimizer: torch.optim.Optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-5)
        else:
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-4, momentum=0.9)
        self.optimizer_name = optimizer
        self._x = torch.randn(self.batch, self.width, device=device)
        self.step()  # creates the optimizer state
        self.sync()

    def describe(self) -> str:
        layers = len(self.model)
        return f"MLP {layers} x {self.width}x{self.width} + {self.optimizer_name}, batch {self.batch}, {self.device}"

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def forward_backward(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.model(self._x).pow(2).mean().backward()

    def step(self) -> None:
        self.forward_backward()
        self.optimizer.step()

    def sync_training(self) -> None:
        """Wait for the training (current) stream only: not for copies a save queued on a stream of its own."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def timed(self, fn: Any, training_stream_only: bool = False) -> float:
        """Seconds ``fn`` takes, its GPU work included (``training_stream_only``: the work on the training
        stream; the device is idle when it starts either way)."""
        self.sync()
        start = time.perf_counter()
        fn()
        if training_stream_only:
            self.sync_training()
        else:
            self.sync()
        return time.perf_counter() - start

    def timed_both(self, fn: Any) -> tuple[float, float]:
        """Seconds until the training stream may go on after ``fn`` (what a loop waits for), and until the whole
        device is idle too (the copies a save queued on a stream of its own included): one call of ``fn``."""
        self.sync()
        start = time.perf_counter()
        fn()
        self.sync_training()
        loop = time.perf_counter() - start
        self.sync()
        return loop, time.perf_counter() - start

    def state(self, step: int) -> dict[str, Any]:
        return {
            "step": step,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "cursor": {"epoch": 0, "position": step},
        }

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the state (parameters and optimizer state), for raw copy measurements."""
        out = [p.detach() for p in self.model.parameters()]
        for per_param in self.optimizer.state.values():
            out += [v for v in per_param.values() if isinstance(v, torch.Tensor) and v.numel() > 1]
        return out


def copy_seconds(workload: Workload, repeats: int, buffer_like: Any) -> list[float]:
    """Seconds per copy of the whole state into buffers ``buffer_like(tensor)`` allocated beforehand, or [] on
    CPU (a warm-up copy first)."""
    if workload.device.type != "cuda":
        return []
    sources = workload.tensors()
    buffers = [buffer_like(t) for t in sources]

    def copy_all() -> None:
        for buf, src in zip(buffers, sources, strict=True):
            buf.copy_(src, non_blocking=True)

    copy_all()
    workload.sync()
    return [workload.timed(copy_all) for _ in range(repeats)]


def pinned_copy_seconds(workload: Workload, repeats: int) -> list[float]:
    """A device-to-host copy of the whole state into pinned buffers allocated beforehand (the floor for any
    staging of CUDA state): median-able seconds per copy, or [] on CPU."""
    return copy_seconds(workload, repeats, lambda t: torch.empty(t.shape, dtype=t.dtype, pin_memory=True))
