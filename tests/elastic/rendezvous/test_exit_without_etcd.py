"""A process with many live ``etcd-v3`` handlers whose etcd is gone exits promptly without ``shutdown()``: the
handlers' exit-time release finds etcd unreachable once and then leaves every other lease to expire, instead of
waiting out a keep-alive and a revoke per lease. Real handlers in a real process, a real etcd SIGKILLed."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from elastic.testing.etcd_server import LocalEtcdCluster

HANDLERS = 16


@pytest.mark.timeout(120)
def test_a_process_with_live_handlers_and_a_dead_etcd_exits_promptly(etcd_member: LocalEtcdCluster) -> None:
    code = textwrap.dedent(f"""
        import sys
        from torch.distributed.elastic.rendezvous import RendezvousParameters
        from elastic.rendezvous.plugin import create_handler
        handlers = []
        for i in range({HANDLERS}):
            h = create_handler(RendezvousParameters("etcd-v3", {etcd_member.endpoints!r}, f"exit-{{i}}", 1, 1,
                               local_addr="127.0.0.1", last_call_timeout="1", node_ttl="2"))
            h.next_rendezvous()
            handlers.append(h)
        print("ready", flush=True)
        sys.stdin.readline()
        # returns without handler.shutdown(): the handlers are released at exit
    """)
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == "ready"
        etcd_member.stop_member(0)  # SIGKILL: etcd is gone
        started = time.monotonic()
        proc.stdin.write("\n")
        proc.stdin.flush()
        proc.wait(timeout=60)
        took = time.monotonic() - started
        assert took < 20, f"the process took {took:.1f}s to exit"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
