"""Signed manifests: with a job's key, only snapshots that job signed are loaded, listed or counted.

Whoever can write the storage but does not hold the key (another job sharing the bucket by mistake or on
purpose) cannot make the job load their files, which could run code when unpickled (``weights_only=False``,
DCP's ``.metadata``).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from elastic.checkpoint import CheckpointOptions, create_checkpoint_manager
from elastic.checkpoint.layout import FileEntry, Manifest, ManifestError, SnapshotKind
from tests.elastic.checkpoint._helpers import assert_same, make_state

SMALL = {"rows": 16, "cols": 8}
KEY = bytes(range(32))
OTHER = bytes(range(1, 33))


def _manifest() -> Manifest:
    files = (FileEntry(path="0123abcd/tensors.bin", size=3, digest="0" * 64),)
    return Manifest(
        step=7, token="0123abcd", kind=SnapshotKind.PACK, files=files, created_unix=1.0, world_size=1, writer_rank=0
    )


def test_a_signed_manifest_loads_with_its_key_and_only_with_it() -> None:
    data = _manifest().to_json(KEY)
    assert Manifest.from_json(data, key=KEY) == _manifest()
    assert Manifest.from_json(data) == _manifest()  # no key: checksums only, as before
    with pytest.raises(ManifestError, match="signature does not match"):
        Manifest.from_json(data, key=OTHER)
    with pytest.raises(ManifestError, match="not signed"):
        Manifest.from_json(_manifest().to_json(), key=KEY)


def test_editing_a_signed_manifest_and_fixing_its_checksum_is_still_refused() -> None:
    import hashlib
    import json

    body = json.loads(_manifest().to_json(KEY))
    body["files"][0]["sha256"] = "1" * 64  # point the job at other bytes
    body.pop("manifest_sha256")
    signature = body.pop("manifest_hmac")
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    body["manifest_sha256"] = hashlib.sha256(canonical).hexdigest()
    body["manifest_hmac"] = signature
    with pytest.raises(ManifestError, match="signature does not match"):
        Manifest.from_json(json.dumps(body).encode(), key=KEY)


def test_a_keyed_job_ignores_newer_snapshots_it_did_not_sign(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    url = str(tmp_path)
    with create_checkpoint_manager(url, CheckpointOptions(signing_key=KEY)) as mine:
        mine.save(5, make_state(5, **SMALL))
    for key in (None, OTHER):  # a writer without the key, and one with another job's key
        with create_checkpoint_manager(url, CheckpointOptions(signing_key=key, keep_last=10)) as foreign:
            foreign.save(9 if key is None else 10, make_state(99, **SMALL))
    with caplog.at_level(logging.WARNING), create_checkpoint_manager(url, CheckpointOptions(signing_key=KEY)) as mgr:
        assert mgr.latest_step() == 5
        snap = mgr.load_latest()
    assert snap is not None and snap.step == 5
    assert_same(snap.state, make_state(5, **SMALL))
    assert any("not signed" in r.getMessage() for r in caplog.records)


def test_signing_key_from_a_mapping_is_hex_and_must_be_long_enough() -> None:
    assert CheckpointOptions.from_mapping({"signing_key": KEY.hex()}).signing_key == KEY
    with pytest.raises(ValueError, match="hex"):
        CheckpointOptions.from_mapping({"signing_key": "not hex"})
    with pytest.raises(ValueError, match="at least 16 bytes"):
        CheckpointOptions(signing_key=b"short")
    assert "signing_key" not in repr(CheckpointOptions(signing_key=KEY))


def test_retention_of_a_keyed_job_never_deletes_snapshots_it_did_not_sign(tmp_path: Path) -> None:
    url = str(tmp_path)
    with create_checkpoint_manager(url, CheckpointOptions(signing_key=OTHER)) as theirs:
        theirs.save(1, make_state(1, **SMALL))
    with create_checkpoint_manager(url, CheckpointOptions(keep_last=10)) as unkeyed:
        unkeyed.save(2, make_state(2, **SMALL))
    with create_checkpoint_manager(url, CheckpointOptions(signing_key=KEY, keep_last=1)) as mine:
        for step in (3, 4, 5):
            mine.save(step, make_state(step, **SMALL))
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["step-000000000001", "step-000000000002", "step-000000000005"]
