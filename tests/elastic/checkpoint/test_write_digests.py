"""Sharded snapshots hash their files as DCP writes them (elastic/checkpoint/write_digests.py): no read-back of
the data files during a save, the same digests as the files on disk, and a read-back wherever a file was not
written in order."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import blake3
import pytest
import torch
from torch.distributed.checkpoint.filesystem import FileSystem

from elastic.checkpoint import CheckpointOptions, StateLayout, create_checkpoint_manager
from elastic.checkpoint.digest import DigestAlgorithm, digest_bytes
from elastic.checkpoint.storage import BinaryReader, LocalStorage
from elastic.checkpoint.write_digests import WriteDigests, hash_while_writing

pytestmark = pytest.mark.timeout(60)


class _Writer:
    """Stands for a DCP storage writer: what :func:`hash_while_writing` uses of one is its ``fs``."""

    def __init__(self) -> None:
        self.fs: Any = FileSystem()  # torch's own (DCP's local file system)


def test_a_file_written_in_order_is_recorded_with_the_size_and_digest_of_its_bytes_on_disk(tmp_path: Path) -> None:
    writer, digests = _Writer(), WriteDigests(DigestAlgorithm.BLAKE3)
    assert hash_while_writing(writer, digests)
    path = tmp_path / "__0_0.distcp"
    with writer.fs.create_stream(path, "wb") as stream:
        stream.write(b"abc" * 1000)
        stream.write(memoryview(bytearray(range(256))))
        stream.write(torch.arange(100, dtype=torch.int32).numpy())  # any contiguous buffer
        assert stream.tell() == 3000 + 256 + 400
        stream.close()  # DCP closes the stream itself inside the context
    got = digests.get("__0_0.distcp")
    data = path.read_bytes()
    assert got is not None and got.size == len(data) == 3656
    assert got.digest == blake3.blake3(data).hexdigest()
    with writer.fs.create_stream(path, "rb") as stream:  # reads pass through, unhashed
        assert stream.read() == data


def test_sha256_snapshots_record_sha256_digests(tmp_path: Path) -> None:
    writer, digests = _Writer(), WriteDigests(DigestAlgorithm.SHA256)
    hash_while_writing(writer, digests)
    with writer.fs.create_stream(tmp_path / "f", "wb") as stream:
        stream.write(b"x" * 10)
    got = digests.get("f")
    assert got is not None and got.digest == digest_bytes(DigestAlgorithm.SHA256, b"x" * 10)


def test_files_not_written_start_to_end_in_order_are_not_recorded(tmp_path: Path) -> None:
    writer, digests = _Writer(), WriteDigests(DigestAlgorithm.BLAKE3)
    hash_while_writing(writer, digests)
    with writer.fs.create_stream(tmp_path / "sought", "wb") as stream:
        stream.write(b"abcdef")
        stream.seek(2)  # a writer patching a header afterwards
        stream.write(b"ZZ")
    with writer.fs.create_stream(tmp_path / "truncated", "wb") as stream:
        stream.write(b"abcdef")
        stream.truncate(3)
    with pytest.raises(RuntimeError, match="disk full"), writer.fs.create_stream(tmp_path / "failed", "wb") as stream:
        stream.write(b"abc")
        raise RuntimeError("disk full")
    for _ in range(2):  # the same name twice in one attempt: neither record describes the file
        with writer.fs.create_stream(tmp_path / "twice", "wb") as stream:
            stream.write(b"abc")
    with writer.fs.create_stream(tmp_path / "in-place", "wb") as stream:
        stream.write(b"abc")
        stream.seek(3)  # a seek to where it is: still in order
        stream.write(b"def")
    assert [n for n in ("sought", "truncated", "failed", "twice") if digests.get(n) is not None] == []
    got = digests.get("in-place")
    assert got is not None and got.digest == blake3.blake3(b"abcdef").hexdigest()


def test_a_writer_without_fs_create_stream_is_left_alone_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    class Other:
        fs = None

    caplog.set_level(logging.WARNING, logger="elastic.checkpoint.write_digests")
    writer = Other()
    assert not hash_while_writing(writer, WriteDigests(DigestAlgorithm.BLAKE3))
    assert writer.fs is None and "read back to be hashed" in caplog.text


class _CountingStorage(LocalStorage):
    """Our local storage, counting the files opened for reading."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.reads: list[str] = []

    @contextlib.contextmanager
    def open_read(self, rel: str) -> Iterator[BinaryReader]:
        self.reads.append(rel)
        with super().open_read(rel) as f:
            yield f


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "async"])
def test_a_sharded_save_reads_none_of_its_data_files_back_and_its_manifest_holds_their_digests(
    gloo_world_1: None, tmp_path: Path, blocking: bool
) -> None:
    storage = _CountingStorage(tmp_path / "ck")
    options = CheckpointOptions(layout=StateLayout.SHARDED, verify_after_write="size")
    state = {"w": torch.randn(256, 64), "b": torch.arange(10, dtype=torch.bfloat16), "meta": {"epoch": 3}}
    with create_checkpoint_manager(str(tmp_path / "ck"), options, storage=storage) as manager:
        manager.save(5, state, blocking=blocking)
        manager.wait()
        data_reads = [r for r in storage.reads if r.endswith(".distcp")]
        assert data_reads == [], "data files were read back during the save"
        manifest = manager.list_snapshots()[-1].manifest
        assert manifest is not None
        data = [f for f in manifest.files if f.path.endswith(".distcp")]
        assert data, manifest.files
        for entry in manifest.files:  # every digest is that of the bytes on disk
            on_disk = (tmp_path / "ck" / "step-000000000005" / entry.path).read_bytes()  # token/name
            assert entry.size == len(on_disk) and entry.digest == blake3.blake3(on_disk).hexdigest(), entry.path
        template = {"w": torch.zeros(256, 64), "b": torch.zeros(10, dtype=torch.bfloat16), "meta": {"epoch": -1}}
        snap = manager.load(5, template=template)
    assert torch.equal(snap.state["w"], state["w"]) and torch.equal(snap.state["b"], state["b"])
    assert snap.state["meta"] == {"epoch": 3}
