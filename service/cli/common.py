"""What every ``etrain`` command shares: flags that default to an environment variable, one-line errors, logging.

Every flag can also come from the environment variable named in its help (flags win). Errors are one line on
stderr; exit codes: 0 ok, 1 the job/command failed, 2 bad settings or etcd unreachable, 3 API error.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from typing import Any

__all__ = ["add_flag", "env_or", "fail", "first_line", "setup_logging"]


def env_or(name: str, default: str | None = None) -> str | None:
    value = os.environ.get(name)
    return value if value not in (None, "") else default


def add_flag(
    p: argparse.ArgumentParser, flag: str, var: str, help: str = "", default: str | None = None, **kwargs: Any
) -> None:
    """``flag``, defaulting to ``$var`` (argparse converts a string default with the flag's ``type``)."""
    p.add_argument(flag, default=env_or(var, default), help=f"{help} ({var})".lstrip(), **kwargs)


def first_line(exc: BaseException) -> str:
    """One line for an etcd failure: gRPC errors carry their useful part in ``details = "..."``."""
    text = str(exc)
    found = re.search(r'details = "([^"]*)"', text)
    head = text.splitlines()[0] if text else type(exc).__name__
    if found:
        head = head.split("<_InactiveRpcError")[0].split("<_MultiThreadedRendezvous")[0].rstrip(" :")
        return f"{head}: {found.group(1)}"
    return head


def fail(message: str, code: int = 2) -> int:
    print(f"etrain: {message}", file=sys.stderr)
    return code


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
