"""Whether the jobs on a node can read each other's command lines: ``/proc`` and its ``hidepid`` option.

``/proc/<pid>/cmdline`` holds a job's ``args``, which the API shows only to the job's owner; every user of the
node reads it unless ``/proc`` is mounted with ``hidepid=noaccess`` (1: other users' ``/proc/<pid>`` cannot be
read), ``invisible`` (2: nor listed) or ``ptraceable`` (4: only what one may ptrace is shown). The kernels before
5.8 show the number (``hidepid=2``), later ones the name. ``/proc/<pid>/environ`` needs no option: the kernel
shows it only to the same uid (or ptrace rights). The jobs' processes live in the agent's mount namespace, so the
agent's ``/proc/self/mountinfo`` says what they see.

With ``hidepid`` the agent still has to see the jobs' processes, to stop those that escaped their torchrun before
their uid goes to another job (:func:`service.agent.isolation.kill_processes_of`): it does when one of its groups
is the mount's ``gid=`` (not for ``ptraceable``) or when it has CAP_SYS_PTRACE, which the chart drops.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

__all__ = ["ProcCheck", "ProcMount", "check_proc", "judge_proc", "proc_mount"]

MOUNTINFO = Path("/proc/self/mountinfo")
_CAP_SYS_PTRACE = 19
_HIDEPID = {"0": "off", "1": "noaccess", "2": "invisible", "4": "ptraceable"}
_REMOUNT = "mount -o remount,hidepid=invisible,gid={gid} /proc"


@dataclass(frozen=True)
class ProcMount:
    """The ``/proc`` mount processes see (:func:`proc_mount`): its file system type and options."""

    fstype: str
    options: tuple[str, ...]  # the mount's own, then its super block's

    def _option(self, key: str) -> str | None:
        found = None
        for opt in self.options:
            if opt.startswith(f"{key}="):
                found = opt.partition("=")[2]
        return found

    @property
    def hidepid(self) -> str:
        """``off``, ``noaccess``, ``invisible`` or ``ptraceable`` (numbers as the kernels before 5.8 show them)."""
        value = self._option("hidepid") or "off"
        return _HIDEPID.get(value, value)

    @property
    def gid(self) -> int | None:
        value = self._option("gid")
        return int(value) if value is not None and value.isdigit() else None


@dataclass(frozen=True)
class ProcCheck:
    """What :func:`judge_proc` found: whether jobs' args are hidden from other jobs (None: cannot tell) and a
    warning (None: nothing to fix)."""

    args_hidden: bool | None
    warning: str | None


def _unescape(field: str) -> str:
    """A mountinfo path field: space, tab, newline and backslash are written as octal escapes (``\\040``)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def proc_mount(mountinfo: str, mount_point: str = "/proc") -> ProcMount | None:
    """The mount at ``mount_point`` that processes see, from the text of a ``/proc/<pid>/mountinfo`` (pure):
    of several there, the one no other is mounted on; None when none is there.

    A line: ``ID PARENT MAJ:MIN ROOT MOUNT_POINT MOUNT_OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPER_OPTIONS``."""
    found: list[tuple[str, str, ProcMount]] = []
    for line in mountinfo.splitlines():
        fields = line.split()
        if "-" not in fields[6:]:
            continue
        sep = fields.index("-", 6)
        if len(fields) < sep + 3 or _unescape(fields[4]) != mount_point:
            continue
        options = (*fields[5].split(","), *(fields[sep + 3].split(",") if len(fields) > sep + 3 else ()))
        found.append((fields[0], fields[1], ProcMount(fields[sep + 1], tuple(options))))
    below = {parent for _, parent, _ in found}
    top = [m for mount_id, _, m in found if mount_id not in below] or [m for _, _, m in found]
    return top[-1] if top else None


def judge_proc(mount: ProcMount | None, groups: Sequence[int], caps: int) -> ProcCheck:
    """Whether jobs on the node read each other's args, and whether an agent of ``groups`` (its effective gid
    first, then its supplementary groups) with capabilities ``caps`` sees the jobs' processes (pure)."""
    gid = groups[0] if groups else 0
    if mount is None or mount.fstype != "proc":
        return ProcCheck(
            None,
            "cannot tell whether the jobs on this node can read each other's command lines "
            "(their args): no proc file system at /proc",
        )
    remount = _REMOUNT.format(gid=gid)
    if mount.hidepid == "off":
        shown = (
            "/proc is mounted without hidepid: a job on this node can read the other jobs' command lines (their "
            f"args, which the API shows their owners only) in /proc/<pid>/cmdline; remount it with `{remount}` "
            "(hidepid=2 before Linux 5.8; gid= keeps this agent able to see and stop the jobs' processes). In a "
            "container /proc is the runtime's mount: remounting it needs CAP_SYS_ADMIN there (the chart's agent has "
            "not got it), so on such nodes keep secrets out of jobs' args"
        )
        return ProcCheck(False, shown)
    ptrace = bool(caps >> _CAP_SYS_PTRACE & 1)
    exempt = mount.hidepid in ("noaccess", "invisible") and mount.gid is not None and mount.gid in groups
    if not (ptrace or exempt):
        blind = (
            f"/proc is mounted with hidepid={mount.hidepid}, and this agent (groups {sorted(set(groups))}, no "
            "CAP_SYS_PTRACE) cannot see the jobs' processes: it could not stop one that escaped its torchrun before "
            f"its uid goes to another job; remount it with `{remount}` (or give the agent CAP_SYS_PTRACE)"
        )
        return ProcCheck(True, blind)
    return ProcCheck(True, None)


def check_proc(groups: Sequence[int], caps: int, mountinfo: Path = MOUNTINFO) -> ProcCheck:
    """:func:`judge_proc` on this process's ``/proc`` (``mountinfo``: its mount table)."""
    try:
        text = mountinfo.read_text()
    except OSError as exc:
        return ProcCheck(
            None,
            f"cannot tell whether the jobs on this node can read each other's command lines: "
            f"cannot read {mountinfo}: {exc.strerror or exc}",
        )
    return judge_proc(proc_mount(text), groups, caps)
