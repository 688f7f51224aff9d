"""The root agent deletes and writes in a job's private directory (its HOME) without following what the job left
there: a symlink to a directory of the node, a symlink loop, a link at a secret's name, a tree deeper than
Python's recursion. Real uids (as root), real files: the job's entries are made by a shell running as its uid.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

import pytest

from elastic.etcd.config import EtcdOptions
from service.agent.jobfiles import JobFiles, PreparedJob
from service.agent.nofollow import remove_tree, write_new_secret
from service.core.config import AgentSettings, UidRange
from service.core.models import Assignment, JobSpec

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(os.geteuid() != 0, reason="jobs' uids, and the chown of their files, need root"),
]

R = UidRange(23300, 23309)  # no other test uses these uids


@pytest.fixture
def sandbox() -> Iterator[Path]:
    """A directory every uid may enter (pytest's own temporary directories are root's, 0700), with ``outside``:
    root's 0755 directories and 0644 files that a job must not be able to change through the agent."""
    d = Path(tempfile.mkdtemp(prefix="etrain-links-"))
    d.chmod(0o755)
    outside = d / "outside"
    (outside / "sub").mkdir(parents=True)
    for path in (outside, outside / "sub"):
        path.chmod(0o755)
    (outside / "kept.txt").write_text("not the job's\n")
    (outside / "kept.txt").chmod(0o644)
    yield d
    shutil.rmtree(d)


def _snapshot(*roots: Path, skip: Path | None = None) -> dict[str, tuple[object, ...]]:
    """Mode, owner, group and content (a symlink's target) of everything under ``roots``, links not followed."""
    out: dict[str, tuple[object, ...]] = {}
    for root in roots:
        for top, dirs, files in os.walk(root):
            if skip is not None:
                dirs[:] = [d for d in dirs if Path(top, d) != skip]
            for path in (Path(top), *(Path(top, n) for n in (*dirs, *files))):
                st = path.lstat()
                content: object = None
                if stat.S_ISLNK(st.st_mode):
                    content = os.readlink(path)
                elif stat.S_ISREG(st.st_mode):
                    content = path.read_bytes()
                out[str(path)] = (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, content)
    return out


def _as_job(files: PreparedJob, script: str) -> None:
    """Run ``script`` (sh) as the job's uid in its HOME, as its code could."""
    assert files.user is not None and files.home is not None
    subprocess.run(
        ["sh", "-ec", script],
        cwd=files.home,
        user=files.user.uid,
        group=files.user.gid,
        extra_groups=[],
        check=True,
        timeout=30,
    )


def _agent_files(sandbox: Path) -> JobFiles:
    settings = AgentSettings(
        etcd=EtcdOptions("e:1"), node_name="n1", work_dir=sandbox / "work", job_uid_range=R, job_tmp_dirs=()
    )
    return JobFiles(settings)


def _assignment(job_id: str, generation: int) -> Assignment:
    spec = JobSpec.model_validate({"name": "j", "entrypoint": "train.py"})
    return Assignment(
        job_id=job_id,
        generation=generation,
        spec=spec,
        checkpoint_key="ab" * 32,
        etcd_user="u-j",
        etcd_password="pw-j",
        assigned_at=datetime.now(timezone.utc),
    )


def test_symlinks_and_loops_a_job_leaves_in_its_home_change_nothing_they_point_to_when_it_leaves(
    sandbox: Path,
) -> None:
    jobs = _agent_files(sandbox)
    files = jobs.prepare(_assignment("j-1", 1))
    outside = sandbox / "outside"
    job_dir = sandbox / "work" / "jobs" / "j-1"
    _as_job(
        files,
        f"""
        ln -s {outside} evil                    # ~/evil -> a 0755 directory of root's
        mkdir -p deeper/still && ln -s {outside / "sub"} deeper/still/evil
        ln -s {outside / "kept.txt"} file-link
        ln -s .. up                             # the job's directory above its HOME (0711, the agent's)
        ln -s {job_dir} job-dir
        ln -s loop loop && ln -s b a && ln -s a b && ln -s . self
        mkdir locked && ln -s {outside} locked/evil && chmod 000 locked
        mkfifo fifo
    """,
    )
    before = _snapshot(outside, sandbox / "work", skip=files.home)
    jobs.forget([])
    assert files.home is not None and not os.path.lexists(files.home)
    assert _snapshot(outside, sandbox / "work") == before  # nothing outside the private directory changed
    assert stat.S_IMODE(outside.stat().st_mode) == 0o755 and stat.S_IMODE(job_dir.stat().st_mode) == 0o711


def test_the_next_generation_replaces_a_home_whose_secret_names_are_links_without_writing_through_them(
    sandbox: Path,
) -> None:
    jobs = _agent_files(sandbox)
    first = jobs.prepare(_assignment("j-2", 1))
    outside = sandbox / "outside"
    _as_job(
        first,
        f"""
        rm etcd-password checkpoint-key
        ln -s {outside / "kept.txt"} etcd-password   # the agent writes the job's etcd password here next time
        ln -s {outside} checkpoint-key
        ln -s {outside} evil
    """,
    )
    before = _snapshot(outside)
    second = jobs.prepare(_assignment("j-2", 2))
    assert _snapshot(outside) == before
    assert second.home == first.home and second.user == first.user and second.user is not None
    for name, value in (("etcd-password", "pw-j"), ("checkpoint-key", "ab" * 32)):
        st = (second.home / name).lstat()
        assert stat.S_ISREG(st.st_mode) and (stat.S_IMODE(st.st_mode), st.st_uid) == (0o600, second.user.uid)
        assert (second.home / name).read_text() == value + "\n"
    assert sorted(os.listdir(second.home)) == ["checkpoint-key", "etcd-password"]  # the rest went
    jobs.forget([])
    assert _snapshot(outside) == before


def test_a_home_deeper_than_python_recursion_is_deleted_whole_without_following_the_link_at_its_bottom(
    sandbox: Path,
) -> None:
    jobs = _agent_files(sandbox)
    files = jobs.prepare(_assignment("j-3", 1))
    assert files.home is not None and files.user is not None
    outside = sandbox / "outside"
    fd = os.open(files.home, os.O_RDONLY | os.O_DIRECTORY)
    for level in range(1500):  # the job's own directories, some of them 0000 or read-only
        os.mkdir("d", dir_fd=fd)
        os.chown("d", files.user.uid, files.user.gid, dir_fd=fd, follow_symlinks=False)
        if level % 100 == 0:
            os.symlink(str(outside), "evil", dir_fd=fd)
        sub = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = sub
        if level % 200 == 0:
            os.fchmod(fd, 0o500)  # root writes in it all the same; the agent of the chart could not
    os.symlink(str(outside), "evil", dir_fd=fd)
    os.fchmod(fd, 0o000)
    os.close(fd)
    before = _snapshot(outside)
    jobs.forget([])
    assert not os.path.lexists(files.home)
    assert _snapshot(outside) == before


def test_a_secret_is_never_written_through_a_symlink_or_hard_link_placed_at_its_name(sandbox: Path) -> None:
    private = sandbox / "private"
    private.mkdir(mode=0o700)
    victim = sandbox / "outside" / "kept.txt"
    os.symlink(victim, private / "etcd-password")
    os.link(victim, private / "checkpoint-key")
    before = _snapshot(sandbox / "outside")
    for name in ("etcd-password", "checkpoint-key"):
        with pytest.raises(FileExistsError):
            write_new_secret(private, name, "secret")
    assert _snapshot(sandbox / "outside") == before
    assert write_new_secret(private, "etcd-key.pem", "secret").read_text() == "secret\n"
    assert stat.S_IMODE((private / "etcd-key.pem").stat().st_mode) == 0o600
    private.chmod(0o755)  # a directory others may enter is no place for a secret
    with pytest.raises(PermissionError, match="not a private directory"):
        write_new_secret(private, "other", "secret")
    os.chown(private, R.low, R.low)  # nor one of a job's uid
    private.chmod(0o700)
    with pytest.raises(PermissionError, match="not a private directory"):
        write_new_secret(private, "other", "secret")


def test_removing_a_tree_refuses_a_symlink_in_place_of_its_top_directory(sandbox: Path) -> None:
    os.symlink(sandbox / "outside", sandbox / "home")
    before = _snapshot(sandbox / "outside")
    parent = os.open(sandbox, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(NotADirectoryError):
            remove_tree(parent, "home")
    finally:
        os.close(parent)
    assert _snapshot(sandbox / "outside") == before and (sandbox / "home").is_symlink()
