"""Lustre striping of the checkpoint directory through the ``lfs`` command (when it is installed).

New files and sub-directories inherit a directory's default layout, so striping the root once makes
every snapshot file spread over ``stripe_count`` OSTs in ``stripe_size`` pieces.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
from pathlib import Path

__all__ = ["apply_striping", "setstripe_command"]

logger = logging.getLogger(__name__)


def setstripe_command(lfs: str, directory: str | Path, stripe_count: int, stripe_size: str) -> list[str]:
    """The ``lfs setstripe`` argv for ``directory`` (``stripe_count`` -1 means all OSTs)."""
    return [lfs, "setstripe", "-c", str(stripe_count), "-S", stripe_size, str(directory)]


def apply_striping(directory: str | Path, stripe_count: int, stripe_size: str) -> bool:
    """Run ``lfs setstripe`` on ``directory`` if ``lfs`` is on PATH.

    Returns whether striping was applied.  A failing ``lfs`` (e.g. the directory is not on Lustre) is
    logged as a warning and does not stop training: striping is a performance setting.
    """
    lfs = shutil.which("lfs")
    if lfs is None:
        return False
    argv = setstripe_command(lfs, directory, stripe_count, stripe_size)
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        logger.warning("lfs setstripe on %s failed to run (%s); the default Lustre layout stays", directory, exc)
        return False
    if proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip().replace("\n", " ")
        logger.warning(
            "lfs setstripe on %s exited %d (%s); the default Lustre layout stays",
            directory,
            proc.returncode,
            detail,
        )
        return False
    logger.info("Lustre striping of %s: count %d, size %s", directory, stripe_count, stripe_size)
    return True
