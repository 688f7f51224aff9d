"""Fencing of writers: a save by an old job generation is refused once a newer one has committed, and never
deletes another generation's files (a zombie cut off from the service, saving on SIGTERM, against the
generation that replaced it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastic.checkpoint import CheckpointFencedError, CheckpointOptions, create_checkpoint_manager
from elastic.checkpoint.layout import step_dir
from tests.elastic.checkpoint._helpers import assert_same, make_state

SMALL = {"rows": 16, "cols": 8}


def _save(url: str, step: int, generation: int | None, **kw: object) -> None:
    with create_checkpoint_manager(url, CheckpointOptions(generation=generation, **kw)) as mgr:  # type: ignore[arg-type]
        mgr.save(step, make_state(step, **SMALL), blocking=True)


def test_an_old_generation_cannot_commit_after_a_newer_one_did(tmp_path: Path) -> None:
    url = str(tmp_path)
    _save(url, 10, generation=1)
    _save(url, 20, generation=2)
    with pytest.raises(CheckpointFencedError, match="generation 1 refused: generation 2 committed step 20"):
        _save(url, 30, generation=1)
    with create_checkpoint_manager(url) as mgr:
        assert [s.step for s in mgr.list_snapshots()] == [10, 20]  # nothing of the zombie, nothing lost
        snap = mgr.load_latest()
    assert snap is not None and snap.step == 20
    assert_same(snap.state, make_state(20, **SMALL))
    assert not (tmp_path / step_dir(30)).exists() or not list((tmp_path / step_dir(30)).glob("manifest.json"))


def test_the_same_or_a_newer_generation_saves_on(tmp_path: Path) -> None:
    url = str(tmp_path)
    _save(url, 10, generation=2)
    _save(url, 11, generation=2)  # a restart in place keeps the generation
    _save(url, 12, generation=3)
    with create_checkpoint_manager(url) as mgr:
        assert [s.step for s in mgr.list_snapshots()] == [10, 11, 12]
        assert mgr.load_latest().manifest.meta["generation"] == "3"  # type: ignore[union-attr]


def test_a_save_never_deletes_another_generations_attempt_at_the_same_step(tmp_path: Path) -> None:
    url = str(tmp_path)
    in_progress = tmp_path / step_dir(40) / "abcdef0123456789"  # generation 5 is writing step 40 right now
    in_progress.mkdir(parents=True)
    (in_progress / "tensors.bin").write_bytes(b"half written")
    _save(url, 40, generation=4)  # the zombie commits the same step first (nothing newer committed yet)
    assert (in_progress / "tensors.bin").read_bytes() == b"half written"


def test_without_generations_a_retry_cleans_up_dead_attempts_at_its_step(tmp_path: Path) -> None:
    url = str(tmp_path)
    dead = tmp_path / step_dir(40) / "abcdef0123456789"
    dead.mkdir(parents=True)
    (dead / "tensors.bin").write_bytes(b"crashed half way")
    _save(url, 40, generation=None)
    assert not dead.exists()
