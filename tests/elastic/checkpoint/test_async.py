"""Background saves: callers wait only for the in-memory copy; one save in flight; errors surface later."""

from __future__ import annotations

import copy
import shutil
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

from elastic.checkpoint import CheckpointOptions, CheckpointWriteError, create_checkpoint_manager
from tests.elastic.checkpoint._helpers import assert_same, make_state

SMALL = {"rows": 128, "cols": 64}


class Gate:
    """An event hook that holds the writer thread at ``data_begin`` until released; counts concurrency."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.reached = threading.Event()
        self.active = 0
        self.max_active = 0
        self._lock = threading.Lock()

    def __call__(self, name: str) -> None:
        with self._lock:
            if name == "save_begin":
                self.active += 1
                self.max_active = max(self.max_active, self.active)
            elif name == "cleanup_done":
                self.active -= 1
        if name == "data_begin":
            self.reached.set()
            assert self.release.wait(30), "test never released the writer"


@pytest.mark.timeout(60)
def test_save_returns_while_the_write_is_still_running_and_snapshot_is_a_copy(tmp_path: Path) -> None:
    gate = Gate()
    state = make_state(1, **SMALL)
    expected = copy.deepcopy(state)
    with create_checkpoint_manager(str(tmp_path), CheckpointOptions(), events=gate) as mgr:
        mgr.save(1, state)  # returns although the writer is held before writing any data
        assert gate.reached.wait(10)
        assert mgr.in_flight and mgr.latest_step() is None
        state["model"]["weight"].add_(1.0)  # training goes on and mutates the live tensors
        state["cursor"]["position"] = 999
        gate.release.set()
        mgr.wait()
        assert not mgr.in_flight
        snap = mgr.load_latest()
    assert snap is not None
    assert_same(snap.state, expected)


@pytest.mark.timeout(60)
def test_a_new_save_waits_for_the_one_in_flight(tmp_path: Path) -> None:
    gate = Gate()
    with create_checkpoint_manager(str(tmp_path), CheckpointOptions(), events=gate) as mgr:
        mgr.save(1, make_state(1, **SMALL))
        assert gate.reached.wait(10)
        second = threading.Thread(target=mgr.save, args=(2, make_state(2, **SMALL)))
        second.start()
        second.join(0.5)
        assert second.is_alive(), "second save started while the first was in flight"
        gate.release.set()
        second.join(10)
        assert not second.is_alive()
        mgr.wait()
        assert [s.step for s in mgr.list_snapshots()] == [1, 2]
    assert gate.max_active == 1


@pytest.mark.timeout(60)
def test_background_failure_is_raised_by_the_next_save_then_saving_recovers(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    with create_checkpoint_manager(str(root)) as mgr:
        mgr.check_storage()
        mgr.save(1, make_state(1, **SMALL), blocking=True)
        shutil.rmtree(root)
        root.write_text("not a directory any more")  # storage breaks under the running job
        mgr.save(2, make_state(2, **SMALL))  # staging succeeds; the write fails in the background
        with pytest.raises(CheckpointWriteError, match=r"step 2 .*not a directory"):
            mgr.save(3, make_state(3, **SMALL))
        root.unlink()
        mgr.save(4, make_state(4, **SMALL))  # the error was reported once; saving works again
        mgr.wait()
        assert mgr.latest_step() == 4


@pytest.mark.timeout(60)
def test_close_raises_a_pending_background_failure(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    root.write_text("a file where the checkpoint directory should be")
    mgr = create_checkpoint_manager(str(root))
    mgr.save(1, make_state(1, **SMALL))
    with pytest.raises(CheckpointWriteError, match="step 1"):
        mgr.close()
    mgr.close()  # closed for good; a second close is a no-op


class HoldBeforeStaging(Gate):
    def __call__(self, name: str) -> None:
        if name == "staging_begin":
            self.reached.set()
            assert self.release.wait(30), "test never released the writer"


@pytest.mark.timeout(60)
def test_overlapped_copy_lets_forward_run_and_holds_the_optimizer_step_until_copied(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def forward_backward() -> None:
        optimizer.zero_grad()
        model(torch.randn(32, 8)).pow(2).mean().backward()

    forward_backward()
    optimizer.step()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    expected = copy.deepcopy(state)
    gate = HoldBeforeStaging()
    with create_checkpoint_manager(str(tmp_path), CheckpointOptions(), events=gate) as mgr:
        mgr.save(1, state, overlap_with=optimizer)
        assert gate.reached.wait(10)  # save returned; parameters and momentum not copied yet
        forward_backward()  # forward runs meanwhile and changes BatchNorm statistics (copied before return)
        stepper = threading.Thread(target=optimizer.step)
        stepper.start()
        stepper.join(0.5)
        assert stepper.is_alive(), "optimizer.step() changed parameters before they were copied"
        gate.release.set()
        stepper.join(10)
        assert not stepper.is_alive()
        mgr.wait()
        snap = mgr.load_latest()
    assert snap is not None
    assert_same(snap.state, expected)
    assert not torch.equal(model[0].weight, expected["model"]["0.weight"])  # training did move on
