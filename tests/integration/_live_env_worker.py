"""A torchrun worker for the live-recovery handler test: it records what torchrun gave it and idles.

Appends one JSON line to ``--out`` per start (pid, ``WORLD_SIZE``, ``RANK``, ``TORCHELASTIC_RESTART_COUNT``,
``ETRAIN_LIVE_PREFIX``, ``ETRAIN_ETCD_ENDPOINTS``), then sleeps until ``--stop`` exists and exits 0.
Standard library only, so that it starts fast.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--stop", required=True, type=Path)
    args = parser.parse_args()
    record = {
        "pid": os.getpid(),
        "world_size": os.environ.get("WORLD_SIZE"),
        "rank": os.environ.get("RANK"),
        "restart": os.environ.get("TORCHELASTIC_RESTART_COUNT"),
        "live_prefix": os.environ.get("ETRAIN_LIVE_PREFIX"),
        "live_nodes": os.environ.get("ETRAIN_LIVE_NODES"),
        "etcd_endpoints": os.environ.get("ETRAIN_ETCD_ENDPOINTS"),
    }
    fd = os.open(args.out, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
    finally:
        os.close(fd)
    while not args.stop.exists():
        time.sleep(0.1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
