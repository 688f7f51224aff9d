"""Stock torchrun, run in a child a prefork zygote forked: ``python -m elastic.prefork -m elastic.prefork.torchrun
ARGS`` (:attr:`elastic.torchrun_cli.TorchrunCommand.forked`). The service's node agent starts a warm job's
torchrun so, from the job's zygote on that node, which forks its workers too; the test harness's forked agents
(:class:`~elastic.testing.torchrun.TorchrunAgent` with ``forked=True``) use the test process's zygote.

A torchrun agent spends 2-3 CPU seconds importing torch before its first line of work, on every node at every
generation of a job (each failure, resize or move starts new torchruns). Forked from a zygote that already
imported torch (and ``torch.distributed.run``, :data:`elastic.prefork.DEFAULT_PRELOAD`), it starts in a fraction
of that. What runs is torchrun's own ``main`` with the client's arguments and environment (the prefork child takes
the client's environment, descriptors, directory and arguments; see :mod:`elastic.prefork`).

One piece of torchrun's state is computed from the environment at import, and the zygote imported it with its own:
the level of the loggers ``torch.distributed.elastic.utils.logging.get_logger`` made (``$LOGLEVEL``). They are
set again here from the client's environment before torchrun runs.
"""

from __future__ import annotations

import logging
import os

_TORCH_LOGGERS = "torch.distributed"


def apply_loglevel(level: str | None = None) -> list[str]:
    """Give every ``torch.distributed`` logger that has a level of its own (set at import by torch's
    ``get_logger`` from ``$LOGLEVEL``) the level of this environment; returns their names."""
    level = level or os.environ.get("LOGLEVEL", "WARNING")
    names = []
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if name.startswith(_TORCH_LOGGERS) and isinstance(logger, logging.Logger) and logger.level != logging.NOTSET:
            logger.setLevel(level)
            names.append(name)
    return names


def main() -> None:
    apply_loglevel()
    from torch.distributed.run import main as torchrun_main

    torchrun_main()


if __name__ == "__main__":
    main()
