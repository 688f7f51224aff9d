"""The host allocator keeps the memory a training step frees (glibc's ``malloc``), set once as the loop starts.

glibc gives large blocks back to the kernel: a block of at least ``M_MMAP_THRESHOLD`` bytes is mapped on its own
and unmapped when freed, and the heap's free top is trimmed once it exceeds ``M_TRIM_THRESHOLD``. Both start small
(128 KiB) and rise only when a large mapped block is freed (glibc's dynamic threshold). A step allocates and frees the
same multi-MiB tensors every step (matmul outputs, gradients, an optimizer's intermediates); when they go back to the
kernel, every page of them is faulted in again at the next step. Whether that happens depends on what the process
happened to free before (not traced further: DDP's reducer, which replaces its buckets after the first iteration,
likely frees a large mapped block early; live mode's reducer keeps its buckets), and a live worker took
5,600 more page faults a step than a DDP one (``perf stat``, issue 52: 1.68 M against 0.29 M over 300 steps of a
4 x 1024^2 MLP with AdamW, batch 16: 14.3 against 16.6 steps/s); with the thresholds set here, 0.14 M each and
16.8 against 16.7 steps/s.

:func:`keep_freed_memory` sets them where glibc's dynamic rule would end up at most (``M_MMAP_THRESHOLD`` 32 MiB,
``M_TRIM_THRESHOLD`` twice that), so that whatever the process freed first, blocks under 32 MiB are reused and up to
64 MiB of freed heap is kept. Nothing is changed where the user chose: ``MALLOC_MMAP_THRESHOLD_``,
``MALLOC_TRIM_THRESHOLD_`` or ``GLIBC_TUNABLES`` set, another allocator preloaded (``LD_PRELOAD``), or
``ETRAIN_HOST_MALLOC=0``; nor off glibc.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
from collections.abc import Mapping

from elastic.contract.env import HOST_MALLOC

logger = logging.getLogger(__name__)

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "keep_freed_memory", "why_not"]

#: glibc's own ceiling for its dynamic mmap threshold on 64-bit (``DEFAULT_MMAP_THRESHOLD_MAX``)
MMAP_THRESHOLD = 32 * 2**20
#: what glibc's dynamic rule pairs with it (twice the mmap threshold)
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # <malloc.h>
_SETTINGS = ((_M_MMAP_THRESHOLD, MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES", "LD_PRELOAD")
_done = False


def why_not(env: Mapping[str, str] = os.environ) -> str | None:
    """Why the thresholds are left alone in this process (None: they are set)."""
    if env.get(HOST_MALLOC, "1").strip() == "0":
        return f"{HOST_MALLOC}=0"
    chosen = [name for name in _USER_SETTINGS if env.get(name)]
    if chosen:
        return f"the process's allocator is configured ({', '.join(chosen)})"
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return "not glibc"
    return None


def keep_freed_memory(env: Mapping[str, str] = os.environ) -> bool:
    """Set glibc's thresholds once per process (see the module docstring); whether they are set now."""
    global _done
    if _done:
        return True
    reason = why_not(env)
    if reason is not None:
        logger.debug("host allocator left as it is: %s", reason)
        return False
    try:
        libc = ctypes.CDLL(None)
        ok = all(libc.mallopt(option, value) == 1 for option, value in _SETTINGS)
    except (OSError, AttributeError):
        ok = False
    if not ok:
        logger.debug("host allocator left as it is: mallopt refused")
        return False
    _done = True
    logger.debug("host allocator: M_MMAP_THRESHOLD %d, M_TRIM_THRESHOLD %d bytes", MMAP_THRESHOLD, TRIM_THRESHOLD)
    return True
