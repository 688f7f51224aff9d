"""Deterministic states and exact comparisons for checkpoint tests."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

T = TypeVar("T", bound=Callable[..., object])


def cuda_only(test: T) -> T:
    """A CUDA test: marked ``cuda`` (``pytest -m cuda``, as scripts/gpu_check.sh runs them), skipped without CUDA."""
    return pytest.mark.cuda(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")(test))


def make_state(step: int, rows: int = 750, cols: int = 1000) -> dict[str, Any]:
    """A state whose every value is a function of ``step`` (so a loaded snapshot proves which save it is)."""
    gen = torch.Generator().manual_seed(1000 + step)
    weight = torch.randn(rows, cols, generator=gen)
    return {
        "step": step,
        "model": {"weight": weight, "bias": torch.randn(cols, generator=gen).to(torch.bfloat16)},
        "counts": torch.arange(step, step + 17, dtype=torch.int64),
        "cursor": {"epoch": step // 10, "position": step % 10},
        "extras": {"name": f"run-{step}", "history": [step, (step, None)]},
    }


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_same(actual: Any, expected: Any, path: str = "state") -> None:
    """Equal structure; tensors bit-identical with the same dtype and shape; NaN == NaN for floats."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{path}: {type(actual).__name__} is not a tensor"
        assert actual.dtype == expected.dtype, f"{path}: dtype {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, f"{path}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
        assert _bits(actual) == _bits(expected), f"{path}: tensor bytes differ"
    elif isinstance(expected, Mapping):
        assert isinstance(actual, Mapping), f"{path}: {type(actual).__name__} is not a mapping"
        assert set(actual) == set(expected), f"{path}: keys {sorted(map(str, actual))} != {sorted(map(str, expected))}"
        for key in expected:
            assert_same(actual[key], expected[key], f"{path}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected), f"{path}: {type(actual).__name__} != {type(expected).__name__}"
        assert len(actual) == len(expected), f"{path}: length {len(actual)} != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same(a, e, f"{path}[{i}]")
    elif isinstance(expected, float) and math.isnan(expected):
        assert isinstance(actual, float) and math.isnan(actual), f"{path}: {actual!r} is not NaN"
    else:
        assert type(actual) is type(expected) and actual == expected, f"{path}: {actual!r} != {expected!r}"


def flip_byte(path: Path, offset_fraction: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * offset_fraction)] ^= 0x5A
    path.write_bytes(bytes(data))
