"""A real writer process for crash tests; the test SIGKILLs it at a chosen point of a save.

argv: URL STORAGE_OPTIONS_JSON MODE
- MODE ``pause``: saves step 1, then saves step 2 with the event hook armed: at the ``CKPT_PAUSE_AT``
  event (``name:count``) it writes ``CKPT_MARKER`` and sleeps until killed.
- MODE ``loop``: saves steps latest+1, latest+2, ... in the background forever, appending each step to
  ``CKPT_MARKER`` once it is known to be committed (after ``wait``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from elastic.checkpoint import CheckpointOptions, create_checkpoint_manager
from elastic.interpreter import freeze_at_exit
from tests.elastic.checkpoint._helpers import make_state

ROWS, COLS = 1500, 2000  # 12 MB of tensors: several 1 MiB chunks, and S3 multipart parts of 5 MiB


class PauseAt:
    def __init__(self, spec: str, marker: Path) -> None:
        name, _, count = spec.partition(":")
        self.name, self.count, self.marker = name, int(count or 1), marker
        self.armed = False
        self.seen = 0

    def __call__(self, event: str) -> None:
        if not self.armed or event != self.name:
            return
        self.seen += 1
        if self.seen == self.count:
            self.marker.write_text(event)
            time.sleep(600)  # the test kills us here


def main() -> None:
    url, storage_options, mode = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    marker = Path(os.environ["CKPT_MARKER"])
    options = CheckpointOptions(storage_options=storage_options, keep_last=1, chunk_bytes=1 << 20)
    if mode == "pause":
        hook = PauseAt(os.environ["CKPT_PAUSE_AT"], marker)
        mgr = create_checkpoint_manager(url, options, events=hook)
        mgr.save(1, make_state(1, ROWS, COLS), blocking=True)
        hook.armed = True
        mgr.save(2, make_state(2, ROWS, COLS), blocking=True)
        marker.write_text("finished without reaching the pause point")
        return
    mgr = create_checkpoint_manager(url, options)
    step = mgr.latest_step() or 0  # continue after the previous (killed) run, as a resumed job would
    while True:
        step += 1
        mgr.save(step, make_state(step, ROWS // 4, COLS))
        mgr.wait()
        with marker.open("a") as f:
            f.write(f"{step}\n")


if __name__ == "__main__":
    freeze_at_exit()  # exit skips the collector's pass over torch's objects (elastic.interpreter)
    main()
