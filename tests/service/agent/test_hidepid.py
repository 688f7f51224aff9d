"""Jobs on a node read each other's command lines (their args) unless /proc is mounted with hidepid: the agent
reads its mount table at start and says so, naming the fix; it also says when hidepid would hide the jobs'
processes from the agent itself. The parsing and the verdict are pure; the start path runs on this machine's
real /proc and on mount tables written to files.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic.etcd.config import EtcdOptions
from elastic.etcd.memory import MemoryEtcdClient
from service.agent.hidepid import MOUNTINFO, ProcMount, judge_proc, proc_mount
from service.agent.jobfiles import JobFiles
from service.agent.node import NodeAgent
from service.core.config import AgentSettings, UidRange

pytestmark = pytest.mark.timeout(30)

R = UidRange(23320, 23329)
PTRACE = 1 << 19  # CAP_SYS_PTRACE

# real lines: a systemd host (optional fields), a kernel before 5.8 (numbers), one after (names, subset=pid)
HOST = "22 1 0:21 / /proc rw,nosuid,nodev,noexec,relatime shared:12 - proc proc rw\n"
OLD_KERNEL = "22 1 0:21 / /proc rw,nosuid,nodev,noexec,relatime shared:12 - proc proc rw,hidepid=2,gid=0\n"
NEW_KERNEL = (
    "30 25 0:5 / /proc rw,nosuid,nodev,noexec,relatime shared:13 master:1 - proc proc rw,hidepid=invisible,subset=pid\n"
)
# a Docker container: its own /proc, with masked and read-only parts mounted below it
CONTAINER = """\
1279 1201 0:127 / / rw,relatime master:612 - overlay overlay rw,lowerdir=/var/lib/docker/overlay2/l/A,upperdir=/d/diff
1280 1279 0:130 / /proc rw,nosuid,nodev,noexec,relatime - proc proc rw
1281 1279 0:131 / /dev rw,nosuid - tmpfs tmpfs rw,size=65536k,mode=755
1290 1281 0:129 / /dev/shm rw,nosuid,nodev,noexec,relatime - tmpfs shm rw,size=65536k
1300 1280 0:130 /bus /proc/bus ro,nosuid,nodev,noexec,relatime - proc proc rw
1301 1280 0:130 /sys /proc/sys ro,nosuid,nodev,noexec,relatime - proc proc rw
1305 1280 0:133 /null /proc/kcore rw,nosuid - tmpfs tmpfs rw,size=65536k,mode=755
"""


def test_the_proc_mount_and_its_hidepid_are_read_from_real_mountinfo_lines() -> None:
    host = proc_mount(HOST)
    assert host is not None and (host.fstype, host.hidepid, host.gid) == ("proc", "off", None)
    old = proc_mount(OLD_KERNEL)
    assert old is not None and (old.hidepid, old.gid) == ("invisible", 0)  # hidepid=2: kernels before 5.8
    new = proc_mount(NEW_KERNEL)
    assert new is not None and (new.hidepid, new.gid) == ("invisible", None)
    container = proc_mount(CONTAINER)  # /proc itself, not /proc/bus, /proc/sys or the masked /proc/kcore
    assert container is not None and (container.fstype, container.hidepid) == ("proc", "off")
    assert proc_mount(CONTAINER, "/proc/kcore") == ProcMount("tmpfs", ("rw", "nosuid", "rw", "size=65536k", "mode=755"))
    # a proc mounted over the first one (the one processes see), listed before or after it
    over = "41 22 0:50 / /proc rw,relatime - proc proc rw,hidepid=ptraceable\n"
    for table in (HOST + over, over + HOST):
        top = proc_mount(table)
        assert top is not None and top.hidepid == "ptraceable"
    noaccess = proc_mount(HOST.replace("proc rw\n", "proc rw,hidepid=1\n"))
    assert noaccess is not None and noaccess.hidepid == "noaccess"
    assert proc_mount("23 1 0:22 / /sys rw,relatime - sysfs sysfs rw\n") is None
    assert proc_mount("") is None
    spaced = proc_mount(r"50 1 0:60 / /mnt/my\040proc rw - proc proc rw,hidepid=invisible" + "\n", "/mnt/my proc")
    assert spaced is not None and spaced.hidepid == "invisible"


def test_the_verdict_names_the_remount_when_args_are_readable_and_when_the_agent_would_go_blind() -> None:
    shown = judge_proc(proc_mount(HOST), [0], 0)
    assert shown.args_hidden is False and shown.warning is not None
    assert "can read the other jobs' command lines" in shown.warning
    assert "`mount -o remount,hidepid=invisible,gid=0 /proc`" in shown.warning and "hidepid=2" in shown.warning
    assert "CAP_SYS_ADMIN" in shown.warning  # what it takes in a container, which the chart does not grant
    assert judge_proc(proc_mount(OLD_KERNEL), [0], 0).warning is None  # hidden, the agent (gid 0) exempt
    assert judge_proc(proc_mount(NEW_KERNEL), [0], PTRACE).warning is None
    blind = judge_proc(proc_mount(NEW_KERNEL), [0, 4], 0)  # no gid=, no CAP_SYS_PTRACE: it sees only its own
    assert blind.args_hidden is True and blind.warning is not None and "cannot see the jobs' processes" in blind.warning
    ptraceable = proc_mount(OLD_KERNEL.replace("hidepid=2", "hidepid=4"))  # gid= exempts no one from ptraceable
    assert judge_proc(ptraceable, [0], 0).warning is not None and judge_proc(ptraceable, [0], PTRACE).warning is None
    unknown = judge_proc(None, [0], 0)
    assert unknown.args_hidden is None and unknown.warning is not None


@pytest.fixture
def work() -> Iterator[Path]:
    """A work directory the jobs' uids could reach (pytest's temporary directories are root's, 0700)."""
    d = Path(tempfile.mkdtemp(prefix="etrain-hidepid-"))
    d.chmod(0o755)
    yield d / "work"
    shutil.rmtree(d)


def _settings(work: Path) -> AgentSettings:
    return AgentSettings(etcd=EtcdOptions("e:1"), node_name="n1", work_dir=work, job_uid_range=R, job_tmp_dirs=())


@pytest.mark.skipif(os.geteuid() != 0, reason="an agent with a uid range needs root")
def test_an_agent_with_a_uid_range_warns_at_start_when_jobs_can_read_each_others_args(
    work: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="service.agent.jobfiles")
    table = tmp_path / "mountinfo"
    table.write_text(HOST)
    assert JobFiles(_settings(work), mountinfo=table).args_hidden is False
    assert "mount -o remount,hidepid=invisible" in caplog.text
    caplog.clear()
    table.write_text(OLD_KERNEL.replace("gid=0", f"gid={os.getegid()}"))
    assert JobFiles(_settings(work), mountinfo=table).args_hidden is True
    assert "hidepid" not in caplog.text
    # the agent's own start path, on this machine's /proc: it warns exactly when the verdict says so
    expected = judge_proc(proc_mount(MOUNTINFO.read_text()), [os.getegid()], PTRACE)
    NodeAgent(_settings(work), MemoryEtcdClient())
    assert ("can read the other jobs' command lines" in caplog.text) == (expected.args_hidden is False)
