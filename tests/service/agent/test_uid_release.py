"""A uid released by a job that left the node passes nothing to the next job given it: the agent deletes what the
uid owns at the top of the temporary directories (directories standing in for /tmp, /var/tmp and /dev/shm here),
never another uid's entry or what a link leads to, and hands a just-released uid out last. Real uids (as root),
real files made by a shell running as the job's uid.
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
from service.agent.isolation import allocate_uid, allocate_uids, kill_processes_of
from service.agent.jobfiles import JobFiles
from service.agent.nofollow import remove_files_of
from service.core.config import AgentSettings, UidRange
from service.core.models import Assignment, JobSpec

pytestmark = pytest.mark.timeout(60)

R = UidRange(23310, 23319)  # no other test uses these uids
OTHER = 23329  # a uid outside R: another user of the node
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="jobs' uids, and the chown of their files, need root")


@pytest.fixture
def node() -> Iterator[Path]:
    """A directory every uid may enter, with ``tmp`` and ``shm`` (1777, root's, as /tmp and /dev/shm are) and
    ``outside`` (root's 0755 directory and 0644 file that no link may get changed)."""
    d = Path(tempfile.mkdtemp(prefix="etrain-release-"))
    d.chmod(0o755)
    for name in ("tmp", "shm"):
        (d / name).mkdir()
        (d / name).chmod(0o1777)
    (d / "outside").mkdir(mode=0o755)
    (d / "outside" / "kept.txt").write_text("not the job's\n")
    yield d
    shutil.rmtree(d)


def _as(uid: int, cwd: Path, script: str) -> None:
    subprocess.run(["sh", "-ec", script], cwd=cwd, user=uid, group=uid, extra_groups=[], check=True, timeout=30)


def _tree(d: Path) -> dict[str, tuple[int, int]]:
    """Owner and mode of each entry under ``d``, links not followed."""
    out = {}
    for top, dirs, files in os.walk(d):
        for name in (*dirs, *files):
            st = os.lstat(os.path.join(top, name))
            out[os.path.relpath(os.path.join(top, name), d)] = (st.st_uid, stat.S_IMODE(st.st_mode))
    return out


def _job_files(node: Path) -> JobFiles:
    settings = AgentSettings(
        etcd=EtcdOptions("e:1"),
        node_name="n1",
        work_dir=node / "work",
        job_uid_range=R,
        job_tmp_dirs=(node / "tmp", node / "shm", node / "missing"),
    )
    return JobFiles(settings)


def _assignment(job_id: str) -> Assignment:
    spec = JobSpec.model_validate({"name": "j", "entrypoint": "train.py"})
    return Assignment(job_id=job_id, generation=1, spec=spec, assigned_at=datetime.now(timezone.utc))


@root_only
def test_a_released_uid_leaves_nothing_of_its_own_in_the_temp_dirs_and_no_one_elses_entry_goes(node: Path) -> None:
    jobs = _job_files(node)
    user = jobs.prepare(_assignment("leaver-1")).user
    assert user is not None
    uid, tmp, shm, outside = user.uid, node / "tmp", node / "shm", node / "outside"
    # another user's entries first (one in a directory of the job's that let everyone write)
    _as(OTHER, tmp, "echo theirs > other-file && mkdir other-dir && echo x > other-dir/f")
    _as(
        uid,
        tmp,
        f"""
        echo left > file && mkfifo fifo
        mkdir -p tree/a/b && echo x > tree/a/b/f && chmod 000 tree/a
        mkdir shared && chmod 777 shared
        ln -s {outside} link-to-dir && ln -s {outside / "kept.txt"} link-to-file && ln -s loop loop
        mkdir etrain-prefork-{uid} && chmod 700 etrain-prefork-{uid}
    """,
    )
    _as(OTHER, tmp / "shared", "echo mine > in-their-dir")
    _as(uid, shm, f"mkdir etrain-{uid} && echo snapshot > etrain-{uid}/slot-0")
    (tmp / "roots").write_text("root's\n")
    lingering = subprocess.Popen(["sleep", "60"], user=uid, group=uid, extra_groups=[], start_new_session=True)
    outside_before = _tree(outside), (outside / "kept.txt").read_text(), stat.S_IMODE(outside.stat().st_mode)
    try:
        jobs.forget([])
        assert lingering.wait(timeout=10) < 0  # killed before its files went
    finally:
        lingering.kill()
    assert sorted(_tree(tmp)) == ["other-dir", "other-dir/f", "other-file", "roots"]
    assert _tree(shm) == {}
    assert (_tree(outside), (outside / "kept.txt").read_text(), stat.S_IMODE(outside.stat().st_mode)) == outside_before


@root_only
def test_a_uid_left_with_files_by_an_earlier_agent_is_cleaned_before_a_job_gets_it(node: Path) -> None:
    uid = allocate_uid("newcomer-1", set(), R)  # the uid the job gets on this (empty) node
    _as(uid, node / "tmp", "echo earlier > left-by-an-earlier-job && mkdir -p d/e")
    jobs = _job_files(node)  # a new agent: it knows nothing of the uid's earlier holder
    assert jobs.prepare(_assignment("newcomer-1")).user is not None
    assert _tree(node / "tmp") == {}
    jobs.forget([])


@root_only
def test_cleaning_a_uid_deletes_its_top_level_entries_only_and_never_follows_a_link_there(node: Path) -> None:
    uid = R.low
    _as(uid, node / "tmp", f"ln -s {node / 'outside'} top-link && mkdir d && echo x > d/f")
    _as(OTHER, node / "tmp", "mkdir others && echo y > others/g")
    assert remove_files_of(uid, [node / "tmp", node / "missing"]) == 2
    assert sorted(_tree(node / "tmp")) == ["others", "others/g"]
    assert (node / "outside" / "kept.txt").read_text() == "not the job's\n"
    assert kill_processes_of(uid) == 0


def test_a_uid_another_job_released_lately_is_handed_out_last_and_a_jobs_own_uid_comes_back() -> None:
    first = allocate_uid("a", set(), R)
    # a job whose hash prefers the uid ``a`` just released
    rival = next(j for j in (f"b{i}" for i in range(10_000)) if allocate_uid(j, set(), R) == first)
    assert allocate_uid(rival, set(), R, recent=[first]) != first
    assert allocate_uid(rival, set(), R, recent=[first]) == allocate_uid(rival, set(), R, recent=[first])
    # every other uid held: of those released lately, the one released longest ago goes first
    spare = R.low if first != R.low else R.high
    held = set(range(R.low, R.high + 1)) - {first, spare}
    assert allocate_uid(rival, held, R, recent=[spare, first]) == spare
    assert allocate_uid(rival, held, R, recent=[first, spare]) == first
    assert allocate_uids({}, ["a", rival], R, recent=[first])[rival] != first


@root_only
def test_the_agent_gives_a_just_released_uid_to_another_job_last_and_back_to_the_job_that_held_it(
    node: Path,
) -> None:
    jobs = _job_files(node)
    user = jobs.prepare(_assignment("a-1")).user
    assert user is not None
    rival = next(j for j in (f"b-{i}" for i in range(10_000)) if allocate_uid(j, set(), R) == user.uid)
    jobs.forget([])
    other = jobs.prepare(_assignment(rival)).user
    assert other is not None and other.uid != user.uid  # the hash preferred it: it went to the rival before
    jobs.forget([])
    back = jobs.prepare(_assignment("a-1")).user
    assert back is not None and back.uid == user.uid  # a job's own uid: none of another job's files to find
    jobs.forget([])
