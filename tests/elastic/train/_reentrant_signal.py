"""A second SIGTERM at every point of the first one's handler (run by ``test_preemption.py``).

A profile hook sends SIGTERM to this process at each function return inside the outermost run of the
watcher's handler; Python runs the handler again, inside the first, at its next call. A lock held at that point
(e.g. inside ``threading.Event.set``) would deadlock: the script would never print its line.
"""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType
from typing import Any

from elastic.train.preemption import PreemptionWatcher


def main() -> int:
    told: list[signal.Signals] = []
    watcher = PreemptionWatcher(on_signal=told.append)
    if sys.argv[1:] == ["handler-tells"]:  # the wakeup fd taken (an event loop's): the handler calls on_signal
        _r, w = os.pipe()
        os.set_blocking(w, False)
        signal.set_wakeup_fd(w)
    watcher.install()
    handler = signal.getsignal(signal.SIGTERM)
    assert callable(handler)
    depth = [0]
    sent = [0]

    def counted(signum: int, frame: FrameType | None) -> None:
        depth[0] += 1
        try:
            handler(signum, frame)
        finally:
            depth[0] -= 1

    def hook(_frame: FrameType, event: str, _arg: Any) -> None:
        if depth[0] == 1 and event in ("return", "c_return"):
            sent[0] += 1
            os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, counted)
    sys.setprofile(hook)
    os.kill(os.getpid(), signal.SIGTERM)
    for _ in range(1000):  # calls: the pending signals' handlers run
        len(told)
    sys.setprofile(None)
    print(f"ok requested={watcher.requested} signal={watcher.signal_name} second_signals={sent[0]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
