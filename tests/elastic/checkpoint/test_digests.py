"""File digests (issue 29): BLAKE3 for new snapshots, SHA-256 snapshots (every one written before) still load;
manifests are validated strictly (unknown algorithm, wrong digest length)."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from pathlib import Path

import blake3
import pytest

from elastic.checkpoint import (
    CheckpointCorruptError,
    CheckpointOptions,
    DigestAlgorithm,
    create_checkpoint_manager,
)
from elastic.checkpoint.digest import check_hex_digest, digest_bytes, new_hasher, parse_algorithm
from elastic.checkpoint.layout import FileEntry, Manifest, ManifestError, SnapshotKind, step_dir
from tests.elastic.checkpoint._helpers import assert_same, flip_byte, make_state
from tests.elastic.checkpoint.conftest import Target

SMALL = {"rows": 64, "cols": 32}
# A snapshot written by the code before this change (commit f038fd8 of main: SHA-256, manifest format 1) of
# make_state(7, rows=8, cols=4); kept byte for byte.
FIXTURE = Path(__file__).parent / "fixtures" / "sha256_v1_snapshot"
TOKEN = "0123abcd"


def manifest_json(root: Path, step: int) -> dict[str, object]:
    return json.loads((root / step_dir(step) / "manifest.json").read_bytes())


def data_files(root: Path, step: int) -> list[Path]:
    return sorted(p for p in (root / step_dir(step)).glob("*/*") if p.is_file())


def test_both_algorithms_hash_the_same_bytes_as_the_reference_implementations() -> None:
    data = bytes(range(256)) * 5000
    assert digest_bytes(DigestAlgorithm.SHA256, data) == hashlib.sha256(data).hexdigest()
    assert digest_bytes(DigestAlgorithm.BLAKE3, data) == blake3.blake3(data).hexdigest()
    threaded = new_hasher(DigestAlgorithm.BLAKE3, threads=-1)
    threaded.update(memoryview(data))  # a memoryview, as the writer hands over, on several threads
    assert threaded.hexdigest() == blake3.blake3(data).hexdigest()
    assert parse_algorithm("blake3") is DigestAlgorithm.BLAKE3
    with pytest.raises(ValueError, match="unknown digest algorithm 'md5' \\(known: sha256, blake3\\)"):
        parse_algorithm("md5")


@pytest.mark.parametrize("algorithm", ["blake3", "sha256"])
def test_snapshots_of_either_algorithm_load_and_a_flipped_byte_is_caught(
    target: Target, algorithm: str, caplog: pytest.LogCaptureFixture
) -> None:
    options = CheckpointOptions(storage_options=target.storage_options, digest_algorithm=algorithm, keep_last=5)
    with create_checkpoint_manager(target.url, options) as mgr:
        mgr.save(1, make_state(1, **SMALL), blocking=True)
        mgr.save(2, make_state(2, **SMALL), blocking=True)
        snap = mgr.load(2)
        assert_same(snap.state, make_state(2, **SMALL))
        assert {f.algorithm for f in snap.manifest.files} == {DigestAlgorithm(algorithm)}
        assert snap.manifest.format_version == (1 if algorithm == "sha256" else 2)
    _flip_first_segment(target, 2)
    reader = CheckpointOptions(storage_options=target.storage_options)  # the reader's own setting plays no part
    with caplog.at_level(logging.WARNING), create_checkpoint_manager(target.url, reader) as mgr:
        with pytest.raises(CheckpointCorruptError, match=f"{algorithm} mismatch in .*/tensors-00000.bin"):
            mgr.load(2)
        snap = mgr.load_latest()
    assert snap is not None and snap.step == 1
    assert_same(snap.state, make_state(1, **SMALL))


def _flip_first_segment(target: Target, step: int) -> None:
    if target.kind == "local":
        (path,) = Path(target.url).joinpath(step_dir(step)).glob("*/tensors-00000.bin")
        flip_byte(path)
        return
    import fsspec

    fs = fsspec.filesystem("s3", **target.storage_options)
    (path,) = fs.glob(f"{target.url}/{step_dir(step)}/*/tensors-00000.bin")
    data = bytearray(fs.cat_file(path))
    data[len(data) // 2] ^= 0x5A
    fs.pipe_file(path, bytes(data))


def test_sha256_snapshots_are_written_in_the_old_manifest_format(tmp_path: Path) -> None:
    with create_checkpoint_manager(str(tmp_path), CheckpointOptions(digest_algorithm="sha256")) as mgr:
        mgr.save(3, make_state(3, **SMALL), blocking=True)
    body = manifest_json(tmp_path, 3)
    assert body["format_version"] == 1
    files = body["files"]
    assert isinstance(files, list)
    for item, path in zip(files, data_files(tmp_path, 3), strict=True):
        assert set(item) == {"path", "size", "sha256"}  # exactly what releases before BLAKE3 read
        assert item["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()


def test_blake3_manifests_name_the_algorithm_per_file(tmp_path: Path) -> None:
    with create_checkpoint_manager(str(tmp_path)) as mgr:  # the default
        mgr.save(3, make_state(3, **SMALL), blocking=True)
    body = manifest_json(tmp_path, 3)
    assert body["format_version"] == 2
    files = body["files"]
    assert isinstance(files, list)
    for item, path in zip(files, data_files(tmp_path, 3), strict=True):
        assert set(item) == {"path", "size", "algorithm", "digest"} and item["algorithm"] == "blake3"
        assert item["digest"] == blake3.blake3(path.read_bytes()).hexdigest()


def test_a_snapshot_written_before_blake3_loads_and_is_verified(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "old"
    shutil.copytree(FIXTURE, root)
    assert manifest_json(root, 7)["format_version"] == 1
    with create_checkpoint_manager(str(root), CheckpointOptions(keep_last=5)) as mgr:
        old = mgr.load(7)
        assert_same(old.state, make_state(7, rows=8, cols=4))
        assert {f.algorithm for f in old.manifest.files} == {DigestAlgorithm.SHA256}
        mgr.save(8, make_state(8, rows=8, cols=4), blocking=True)  # a new save beside it: BLAKE3
        assert {f.algorithm for f in mgr.load(8).manifest.files} == {DigestAlgorithm.BLAKE3}
        assert [s.step for s in mgr.list_snapshots()] == [7, 8]
    flip_byte(data_files(root, 7)[-1])
    with create_checkpoint_manager(str(root)) as mgr, pytest.raises(CheckpointCorruptError, match="sha256 mismatch"):
        mgr.load(7)


def _entry(**item: object) -> dict[str, object]:
    return {"path": f"{TOKEN}/tensors-00000.bin", "size": 3, **item}


def _raw_manifest(version: int, *files: dict[str, object]) -> bytes:
    body = {
        "format_version": version,
        "kind": "pack",
        "step": 5,
        "token": TOKEN,
        "created_unix": time.time(),
        "world_size": 1,
        "writer_rank": 0,
        "files": list(files),
        "meta": {},
    }
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    body["manifest_sha256"] = hashlib.sha256(canonical).hexdigest()
    return json.dumps(body).encode()


@pytest.mark.parametrize(
    ("version", "item", "problem"),
    [
        (2, _entry(algorithm="md5", digest="0" * 32), "unknown digest algorithm 'md5'"),
        (2, _entry(algorithm="blake3", digest="0" * 63), "blake3 digest must be 64 lowercase hex characters"),
        (2, _entry(algorithm="blake3", digest="A" * 64), "blake3 digest must be 64 lowercase hex"),
        (1, _entry(sha256="0" * 128), "sha256 digest must be 64 lowercase hex characters"),
        (1, _entry(algorithm="blake3", digest="0" * 64), "must name sha256 \\(format_version 1\\)"),
        (2, _entry(algorithm="blake3", digest="0" * 64, sha256="0" * 64), "must name sha256, or algorithm and digest"),
        (2, _entry(algorithm="blake3"), "must name sha256, or algorithm and digest"),
        (3, _entry(sha256="0" * 64), "unsupported manifest format_version 3"),
    ],
    ids=["unknown-algorithm", "short", "uppercase", "long-sha256", "v1-blake3", "both", "no-digest", "version-3"],
)
def test_malformed_digest_entries_are_refused(version: int, item: dict[str, object], problem: str) -> None:
    with pytest.raises(ManifestError, match=problem):
        Manifest.from_json(_raw_manifest(version, item))


def test_a_well_formed_raw_manifest_of_each_version_parses() -> None:
    v1 = Manifest.from_json(_raw_manifest(1, _entry(sha256="a" * 64)))
    v2 = Manifest.from_json(_raw_manifest(2, _entry(algorithm="blake3", digest="b" * 64)))
    assert v1.files[0] == FileEntry(f"{TOKEN}/tensors-00000.bin", 3, "a" * 64, DigestAlgorithm.SHA256)
    assert v2.files[0] == FileEntry(f"{TOKEN}/tensors-00000.bin", 3, "b" * 64, DigestAlgorithm.BLAKE3)
    assert Manifest.from_json(v2.to_json()) == v2 and Manifest.from_json(v1.to_json()) == v1
    assert check_hex_digest(DigestAlgorithm.BLAKE3, "b" * 64) and not check_hex_digest(DigestAlgorithm.SHA256, "b")


def test_an_unknown_algorithm_on_storage_is_a_clear_corrupt_error(tmp_path: Path) -> None:
    with create_checkpoint_manager(str(tmp_path)) as mgr:
        mgr.save(5, make_state(5, **SMALL), blocking=True)
    path = tmp_path / step_dir(5) / "manifest.json"
    body = json.loads(path.read_bytes())
    body.pop("manifest_sha256")
    body["files"][0]["algorithm"] = "blake2b"
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    body["manifest_sha256"] = hashlib.sha256(canonical).hexdigest()
    path.write_text(json.dumps(body))
    with (
        create_checkpoint_manager(str(tmp_path)) as mgr,
        pytest.raises(CheckpointCorruptError, match="unknown digest algorithm 'blake2b' \\(known: sha256, blake3\\)"),
    ):
        mgr.load(5)


def test_bad_digest_settings_are_refused_at_construction() -> None:
    with pytest.raises(ValueError, match="digest_algorithm: unknown digest algorithm 'sha1'"):
        CheckpointOptions(digest_algorithm="sha1")
    assert CheckpointOptions().digest_algorithm is DigestAlgorithm.BLAKE3
    assert CheckpointOptions.from_mapping({"digest_algorithm": "sha256"}).file_digest is DigestAlgorithm.SHA256


def test_manifest_entries_keep_the_kind_of_snapshot_they_describe() -> None:
    files = (FileEntry(f"{TOKEN}/a.distcp", 4, "c" * 64, DigestAlgorithm.BLAKE3),)
    manifest = Manifest(5, TOKEN, SnapshotKind.DCP, files, 0.0, 2, 0)
    assert Manifest.from_json(manifest.to_json()).files == files


@pytest.mark.parametrize("algorithm", ["blake3", "sha256"])
def test_sharded_snapshots_name_the_configured_algorithm_and_load(tmp_path: Path, algorithm: str) -> None:
    import torch

    from elastic.checkpoint import StateLayout

    options = CheckpointOptions(layout=StateLayout.SHARDED, digest_algorithm=algorithm)
    state = {"w": torch.arange(48, dtype=torch.float32).reshape(6, 8), "cursor": {"epoch": 3}}
    with create_checkpoint_manager(str(tmp_path), options) as mgr:  # a world of one process, no process group
        mgr.save(4, state, blocking=True)
        snap = mgr.load(4, template={"w": torch.zeros(6, 8), "cursor": {"epoch": -1}})
    assert torch.equal(snap.state["w"], state["w"]) and snap.state["cursor"] == {"epoch": 3}
    assert {f.algorithm for f in snap.manifest.files} == {DigestAlgorithm(algorithm)}
    names = {f.path.rsplit("/", 1)[-1] for f in snap.manifest.files}
    assert ".metadata" in names and any(n.endswith(".distcp") for n in names)
    (part,) = (tmp_path / step_dir(4)).glob("*/part-00000.json")
    key = "sha256" if algorithm == "sha256" else "digest"
    assert all(key in item for item in json.loads(part.read_bytes()))
