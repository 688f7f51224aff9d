"""Segment planning (pure) and the I/O pool: fixed cut points, exact byte streams, all-or-nothing batches."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from elastic.checkpoint.codec import segment_chunks, tensor_layout
from elastic.checkpoint.parallel_io import IoPool, check_stop, io_thread_count
from elastic.checkpoint.segments import (
    Extent,
    Segment,
    plan_segments,
    segment_extents,
    segment_name,
    split_chunks,
    tensor_file_order,
)


def test_segments_are_cut_at_fixed_offsets_and_the_last_one_is_shorter() -> None:
    assert plan_segments(250, 100) == [Segment(0, 0, 100), Segment(1, 100, 200), Segment(2, 200, 250)]
    assert plan_segments(200, 100) == [Segment(0, 0, 100), Segment(1, 100, 200)]
    assert plan_segments(99, 100) == [Segment(0, 0, 99)]  # a small state is one segment
    assert plan_segments(0, 100) == [Segment(0, 0, 0)]  # no tensor data: still one (empty) file
    assert [s.name for s in plan_segments(250, 100)] == ["tensors-00000.bin", "tensors-00001.bin", "tensors-00002.bin"]


def test_extents_split_a_tensor_that_spans_segments_and_keep_the_padding() -> None:
    # tensor 0: bytes [0, 100); padding [100, 128); tensor 1 (empty) skipped; tensor 2: [128, 328)
    table = [{"offset": 0, "nbytes": 100}, {"offset": 128, "nbytes": 0}, {"offset": 128, "nbytes": 200}]
    first, second, third, fourth = plan_segments(328, 96)
    assert segment_extents(table, first) == [Extent(0, 0, 96)]
    assert segment_extents(table, second) == [Extent(0, 96, 4), Extent(None, 0, 28), Extent(2, 0, 64)]
    assert segment_extents(table, third) == [Extent(2, 64, 96)]
    assert segment_extents(table, fourth) == [Extent(2, 160, 40)]
    # a segment that ends inside the padding, and one that starts inside it
    left, right = plan_segments(328, 110)[:2]
    assert segment_extents(table, left) == [Extent(0, 0, 100), Extent(None, 0, 10)]
    assert segment_extents(table, right) == [Extent(None, 0, 18), Extent(2, 0, 92)]
    assert list(split_chunks([Extent(2, 10, 9)], 4)) == [Extent(2, 10, 4), Extent(2, 14, 4), Extent(2, 18, 1)]


def _old_stream(tensors: list[torch.Tensor]) -> bytes:
    """The tensor stream as the single-file writer laid it out: 64-byte aligned, zero padded."""
    out = bytearray()
    for t in tensors:
        out += bytes(-len(out) % 64)
        out += t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return bytes(out)


@pytest.mark.parametrize("segment_bytes", [64, 100, 4096, 1 << 20])
def test_segment_chunks_concatenate_to_exactly_the_packed_stream(segment_bytes: int) -> None:
    gen = torch.Generator().manual_seed(3)
    tensors = [
        torch.randn(37, generator=gen),
        torch.zeros(0),
        torch.randint(0, 255, (301,), dtype=torch.uint8, generator=gen),
        torch.randn(5, 7, generator=gen).to(torch.bfloat16),
        torch.tensor(3.5, dtype=torch.float64),
    ]
    table, total = tensor_layout(tensors)
    expected = _old_stream(tensors)
    assert len(expected) == total
    segments = plan_segments(total, segment_bytes)
    pieces = [b"".join(bytes(c) for c in segment_chunks(tensors, table, seg, 16)) for seg in segments]
    assert [len(p) for p in pieces] == [seg.size for seg in segments]
    assert all(len(c) <= 16 for seg in segments for c in segment_chunks(tensors, table, seg, 16))
    assert b"".join(pieces) == expected


def test_tensor_files_are_the_legacy_file_or_gapless_segments_in_order() -> None:
    names = ["skeleton.pt", segment_name(2), segment_name(0), segment_name(1)]
    assert tensor_file_order(names) == [segment_name(0), segment_name(1), segment_name(2)]
    assert tensor_file_order(["skeleton.pt", "tensors.bin"]) == ["tensors.bin"]
    with pytest.raises(ValueError, match=r"lacks tensor segment tensors-00001\.bin"):
        tensor_file_order([segment_name(0), segment_name(2)])
    with pytest.raises(ValueError, match="both"):
        tensor_file_order(["tensors.bin", segment_name(0)])
    with pytest.raises(ValueError, match="no tensor data"):
        tensor_file_order(["skeleton.pt"])


def test_io_threads_default_to_the_machine_and_honour_the_option() -> None:
    assert 1 <= io_thread_count(None) <= 8
    assert io_thread_count(3) == 3


def _pool_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("test-io")]


@pytest.mark.timeout(30)
def test_pool_runs_tasks_side_by_side_and_returns_results_in_order() -> None:
    barrier = threading.Barrier(3, timeout=10)  # only passes if three tasks run at the same time

    def task(i: int) -> int:
        barrier.wait()
        return i * 10

    with IoPool(3, name="test-io") as pool:
        assert pool.run_all([lambda stop, i=i: task(i) for i in range(3)]) == [0, 10, 20]  # type: ignore[misc]
        assert len(_pool_threads()) == 3
    assert _pool_threads() == []


@pytest.mark.timeout(30)
def test_first_failure_stops_the_others_and_all_have_ended_before_it_is_raised() -> None:
    started = threading.Event()
    ended: list[str] = []

    def long_task(stop: threading.Event) -> None:
        started.set()
        try:
            for _ in range(1000):  # 10 s unless told to stop
                check_stop(stop)
                time.sleep(0.01)
        finally:
            ended.append("long")

    def failing(stop: threading.Event) -> None:
        assert started.wait(10)
        raise OSError("disk full")

    never_run: list[int] = []
    with IoPool(2, name="test-io") as pool:
        mark = time.monotonic()
        with pytest.raises(OSError, match="disk full"):
            pool.run_all([long_task, failing, lambda stop: never_run.append(1)])
        assert ended == ["long"], "run_all returned before the other task had ended"
        assert time.monotonic() - mark < 5, "the other task was not stopped"
        assert never_run == [], "a task queued behind the failure still ran"
        assert pool.run_all([lambda stop: 7]) == [7]  # the pool is usable after a failed batch
    assert _pool_threads() == []
    with pytest.raises(RuntimeError, match="closed"):
        pool.run_all([lambda stop: 1])
