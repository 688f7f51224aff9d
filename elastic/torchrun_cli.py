"""The stock ``torchrun`` command line, built in one place: by the service's node agent for every job
generation, and by the test and benchmark harnesses (:mod:`elastic.testing.torchrun`).

``python -m torch.distributed.run`` is used rather than the ``torchrun`` script so that the interpreter is
the one given. With ``prefork`` the workers start as ``elastic.prefork`` clients, forked warm by the
agent's zygote (:mod:`elastic.prefork`); with ``forked`` torchrun itself does
(:mod:`elastic.prefork.torchrun`).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["COLD", "FORKED", "TorchrunCommand", "format_rdzv_conf"]

#: what follows the interpreter in a torchrun command: a fresh one, or a prefork client's (:mod:`elastic.prefork`)
COLD = ("-m", "torch.distributed.run")
FORKED = ("-m", "elastic.prefork", "-m", "elastic.prefork.torchrun")


def format_rdzv_conf(conf: Mapping[str, object]) -> str:
    """``--rdzv-conf``'s ``key=value,key=value`` form."""
    return ",".join(f"{k}={v}" for k, v in conf.items())


@dataclass(frozen=True)
class TorchrunCommand:
    """One torchrun invocation (a job generation on one node)."""

    rdzv_endpoint: str
    run_id: str
    nnodes: str  # "N" or "MIN:MAX"
    entrypoint: str  # a script path, or a module name when ``module``
    args: Sequence[str] = ()
    module: bool = False
    nproc_per_node: int = 1
    rdzv_backend: str = "etcd-v3"
    rdzv_conf: str | None = None  # None: none on the command line (torchrun also reads PET_RDZV_CONF)
    max_restarts: int = 3
    monitor_interval: float = 0.1
    local_addr: str | None = None
    prefork: bool = False
    python: str = sys.executable
    #: torchrun itself forked from the zygote its workers use (``$ETRAIN_PREFORK_OWNER``/``_KEY`` name it)
    forked: bool = False

    def argv(self) -> list[str]:
        cmd = [
            self.python,
            *(FORKED if self.forked else COLD),
            f"--nnodes={self.nnodes}",
            f"--nproc-per-node={self.nproc_per_node}",
            f"--rdzv-backend={self.rdzv_backend}",
            f"--rdzv-endpoint={self.rdzv_endpoint}",
            f"--rdzv-id={self.run_id}",
            f"--max-restarts={self.max_restarts}",
            f"--monitor-interval={self.monitor_interval:g}",
        ]
        if self.rdzv_conf is not None:
            cmd.append(f"--rdzv-conf={self.rdzv_conf}")
        if self.local_addr:
            cmd.append(f"--local-addr={self.local_addr}")
        if self.prefork:  # torchrun starts elastic.prefork clients; the node's zygote forks the workers
            cmd += ["--module", "elastic.prefork"]
            cmd += ["-m", self.entrypoint] if self.module else [self.entrypoint]
        else:
            cmd += ["--module", self.entrypoint] if self.module else [self.entrypoint]
        return [*cmd, *self.args]
