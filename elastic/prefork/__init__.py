"""Warm worker starts under stock torchrun: a per-agent zygote with torch imported forks the workers.

torchrun re-spawns every worker of every node on each failure or membership change. A fresh Python that
imports torch, and builds its first optimizer (which imports ``torch._dynamo``), spends 2-3 s of CPU before
the script's first line of real work; on every restart that is most of the recovery time. Run the script
through this module instead::

    torchrun --rdzv-backend=etcd-v3 ... -m elastic.prefork train.py --lr 0.1
    torchrun ... -m elastic.prefork -m mypkg.train --lr 0.1

Each worker process torchrun starts is then a small *client*: it asks its agent's *zygote* to fork a child
that runs the script, hands it its stdin/stdout/stderr, environment, working directory and arguments,
forwards the signals it receives (SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, SIGCONT) to the child and
exits with the child's exit code (or dies of the child's signal). The first worker of an agent starts the
zygote (one per torchrun agent, keyed by the agent's pid and start time) and waits for it: the first
start costs what a cold start costs, every restart after it forks from an interpreter that already has
the modules of ``ETRAIN_PREFORK_PRELOAD`` imported (default :data:`DEFAULT_PRELOAD`).

Lifetimes (no orphans): if the client dies, even by SIGKILL, the zygote SIGKILLs its child; every child
dies with the zygote (``PR_SET_PDEATHSIG``); the zygote exits when its torchrun agent does. A child runs in
a session of its own, as torchrun's workers do; :func:`forked_worker` maps a client's pid to its child's,
for tools that signal workers directly.

Contract and limits: the child is a fork of an interpreter that imported torch but never initialised
CUDA, started a thread of its own or opened a process group, so it behaves like a fresh worker with two
exceptions: ``sys.modules`` already holds the preloaded modules (module-level state they compute from the
environment at import, e.g. ``TORCH_LOGS``, comes from the agent's environment, which is the same for every
worker of a torchrun agent), and Python's hash seed is the zygote's. What the preload created is frozen
(:func:`elastic.interpreter.loading`: the collector never traverses it again, in the zygote or a child, and a
child's collections leave those pages shared). Interpreter shutdown in the child runs
``atexit`` handlers and joins non-daemon threads, then exits without running object finalisers. With
``ETRAIN_PREFORK=0``, or if the zygote cannot be started, the script runs in the client process itself
(a cold start, with a warning in the second case).

Trust: the socket lives in ``$ETRAIN_PREFORK_DIR`` or ``/tmp/etrain-prefork-<uid>``, which must be a private
directory (:func:`elastic.runtime_dir.private_dir`: created 0700; one another user owns, a symlink, or one
group or others may use is refused and the worker starts cold, with a warning naming its owner and mode),
since each client sends its environment there. The zygote reads requests without blocking (one selector
loop, single-threaded since it forks), each at most :data:`~elastic.prefork.common.MAX_MESSAGE` bytes and
complete within :data:`~elastic.prefork.zygote.REQUEST_DEADLINE_S`, so no client can stall another's start;
a request over the cap makes its client start cold instead.
"""

from elastic.prefork.client import main, prestart, stop_zygote
from elastic.prefork.common import DEFAULT_PRELOAD, Target, forked_worker, socket_path, worker_tree

__all__ = [
    "DEFAULT_PRELOAD",
    "Target",
    "forked_worker",
    "main",
    "prestart",
    "socket_path",
    "stop_zygote",
    "worker_tree",
]
