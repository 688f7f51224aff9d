"""Pure decisions: manifest encoding and checks, retention planning, writer choice, step directories."""

from __future__ import annotations

import json

import pytest

from elastic.checkpoint import CheckpointOptions
from elastic.checkpoint.layout import (
    FileEntry,
    Manifest,
    ManifestError,
    SnapshotKind,
    garbage_step_dirs,
    listing_problems,
    parse_step_dir,
    plan_retention,
    step_dir,
    writer_rank_for,
)

TOKEN = "0123456789abcdef"


def manifest(step: int = 7, files: tuple[FileEntry, ...] | None = None) -> Manifest:
    return Manifest(
        step=step,
        token=TOKEN,
        kind=SnapshotKind.PACK,
        files=files
        or (FileEntry(f"{TOKEN}/tensors.bin", 10, "a" * 64), FileEntry(f"{TOKEN}/skeleton.pt", 3, "b" * 64)),
        created_unix=1.5,
        world_size=4,
        writer_rank=0,
        meta={"torch": "2.13.0"},
    )


def test_manifest_round_trips_through_json() -> None:
    original = manifest()
    assert Manifest.from_json(original.to_json(), expected_step=7) == original
    assert original.total_bytes == 13


def test_manifest_with_any_changed_field_is_rejected_by_its_own_checksum() -> None:
    body = json.loads(manifest().to_json())
    body["files"][0]["size"] = 11
    with pytest.raises(ManifestError, match="checksum"):
        Manifest.from_json(json.dumps(body).encode())


def test_truncated_manifest_is_rejected() -> None:
    data = manifest().to_json()
    with pytest.raises(ManifestError):
        Manifest.from_json(data[: len(data) // 2])


def test_manifest_in_the_wrong_step_directory_is_rejected() -> None:
    with pytest.raises(ManifestError, match="step 7"):
        Manifest.from_json(manifest().to_json(), expected_step=8)


@pytest.mark.parametrize("bad_path", ["../escape", f"{TOKEN}/../x", "othertoken0000/x", TOKEN])
def test_manifest_paths_outside_the_attempt_directory_are_rejected(bad_path: str) -> None:
    with pytest.raises(ManifestError):
        Manifest.from_json(manifest(files=(FileEntry(bad_path, 1, "c" * 64),)).to_json())


def test_listing_problems_name_missing_and_resized_files() -> None:
    problems = listing_problems(manifest(), {f"{TOKEN}/tensors.bin": 9})
    assert problems == [
        f"{TOKEN}/tensors.bin has 9 bytes, manifest says 10",
        f"{TOKEN}/skeleton.pt is missing",
    ]
    assert listing_problems(manifest(), {f"{TOKEN}/tensors.bin": 10, f"{TOKEN}/skeleton.pt": 3, "x": 1}) == []


def test_retention_keeps_last_k_counting_the_one_just_written() -> None:
    assert plan_retention([1, 2, 3, 4, 5], just_written=5, keep_last=2) == [1, 2, 3]
    assert plan_retention([5], just_written=5, keep_last=1) == []


def test_retention_keeps_every_nth_step_as_well() -> None:
    assert plan_retention([10, 20, 30, 40, 50, 60], just_written=60, keep_last=2, keep_every=20) == [10, 30]


def test_retention_never_touches_the_just_written_or_newer_snapshots() -> None:
    # step 200 may be a corrupt leftover the run resumed before; only older snapshots are candidates
    assert plan_retention([100, 150, 200], just_written=150, keep_last=1) == [100]


def test_garbage_is_only_uncommitted_directories_older_than_the_new_snapshot() -> None:
    assert garbage_step_dirs([1, 2, 3, 4, 9], committed_steps=[1, 4], just_written=4) == [2, 3]


def test_writer_is_rank_zero_unless_configured_inside_the_world() -> None:
    assert writer_rank_for(8) == 0
    assert writer_rank_for(8, configured=3) == 3
    assert writer_rank_for(2, configured=3) == 0


def test_step_directories_sort_by_step_and_parse_back() -> None:
    assert step_dir(42) == "step-000000000042"
    assert parse_step_dir(step_dir(42)) == 42
    assert parse_step_dir("step-12") is None and parse_step_dir(".probe-1") is None
    assert sorted([step_dir(100), step_dir(9)]) == [step_dir(9), step_dir(100)]


def test_options_reject_bad_values_naming_the_field() -> None:
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointOptions(keep_last=0)
    with pytest.raises(ValueError, match="lustre_stripe_size"):
        CheckpointOptions(lustre_stripe_size="4 MB")
    with pytest.raises(ValueError, match="unknown checkpoint option"):
        CheckpointOptions.from_mapping({"keep_lats": 2})
    assert CheckpointOptions.from_mapping({"keep_last": 5, "layout": "sharded"}).layout.value == "sharded"
