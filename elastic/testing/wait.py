"""Polling helpers of the test harnesses: one that answers, one that insists.

:func:`wait_until` returns whether ``predicate`` became true in time (the caller asserts, so the
assertion line says what was expected). :func:`wait_for` returns the first truthy value of ``check``
and raises ``AssertionError`` naming what was awaited and the last value seen when it never comes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

__all__ = ["wait_for", "wait_until"]

T = TypeVar("T")


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    """Poll ``predicate`` until it is true or ``timeout`` seconds pass; the final answer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def wait_for(
    check: Callable[[], T],
    timeout: float = 15.0,
    interval: float = 0.1,
    *,
    what: str = "condition",
    retry_on: tuple[type[BaseException], ...] = (),
) -> T:
    """Poll ``check`` until it returns something truthy and return that; errors of the types in
    ``retry_on`` count as "not yet". After ``timeout`` seconds: ``AssertionError`` with the last value."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            value = check()
        except retry_on as exc:
            last = exc
        else:
            if value:
                return value
            last = value
        time.sleep(interval)
    raise AssertionError(f"{what} not met within {timeout}s (last: {last!r})")
