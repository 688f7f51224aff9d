"""Training progress reported by a job's workers to one etcd key that the job service reads.

The service's node agent sets the progress key and the etcd connection in each worker's environment
(:class:`elastic.env.WorkerEnv`); :func:`create_reporter` builds a reporter from them. Outside the service
(plain torchrun, tests) the variables are absent and the reporter does nothing, so training code can
always call it.

Only rank 0 writes (one key per job, last value wins). ``report`` never waits for etcd: it leaves the report
in a one-value slot that a background thread writes, at most once per ``min_interval`` (whether or not the
previous write succeeded) unless the report is forced (a committed checkpoint); reports in between are
coalesced into the latest. While etcd is unreachable the latest report is retried; ``close`` waits a bounded
time for it. A failed write is logged: progress reporting never stops or slows training.

The reader side (the service's controller) trusts nothing: any job's rank 0 writes its key, so
:meth:`Progress.from_json` checks every field's type and range and raises :class:`InvalidProgressError`
for anything else.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from datetime import timedelta
from typing import Any

from elastic.env import WorkerEnv
from elastic.etcd import EtcdClient, EtcdError, create_client

logger = logging.getLogger(__name__)

__all__ = [
    "MAX_PROGRESS_BYTES",
    "EtcdProgressReporter",
    "InvalidProgressError",
    "NullProgressReporter",
    "Progress",
    "ProgressReporter",
    "create_reporter",
]

#: The largest progress value :meth:`Progress.from_json` reads (a report is well under 1 KiB plus its nodes).
MAX_PROGRESS_BYTES = 256 * 1024
_MAX_INT = 2**63 - 1  # counts and steps: what etcd's JSON readers (Go int64) take too
_MAX_TIME = 253_402_214_400.0  # 9999-12-31T00:00:00Z: every time below converts to a datetime
_MAX_PATH = 4096  # characters of a checkpoint path
_MAX_NODES = 10_000
_MAX_NODE_NAME = 256
_MAX_EXTRA_DEPTH = 16  # nesting of the free-form ``extra`` values


class InvalidProgressError(ValueError):
    """A progress value that is not a valid report: not UTF-8 JSON, not an object, too large, or a field of
    the wrong type or out of range. The only error :meth:`Progress.from_json` raises."""


@dataclass(frozen=True)
class Progress:
    """One progress report (JSON in etcd). ``checkpoint_*`` describe the latest *committed* checkpoint.

    Read with :meth:`from_json`, every field has exactly its annotated type: counts are ``int`` (never
    ``bool``) within ``[0, 2**63)``, ``world_size`` at least 1, ``time`` a finite ``float`` of seconds since the
    epoch before the year 10000, ``loss`` finite, strings valid Unicode (no lone surrogates).
    """

    step: int
    world_size: int
    time: float
    total_steps: int | None = None
    loss: float | None = None
    generation: int | None = None
    restart_count: int = 0
    checkpoint_step: int | None = None
    checkpoint_path: str | None = None
    #: the service's names of the nodes the workers of this round run on (sorted), when known
    nodes: list[str] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> bytes:
        """Strict JSON: a non-finite float (a diverged loss) is written as null. Raises ``TypeError`` or
        ``ValueError`` for values JSON cannot hold (an object in ``extra``)."""
        return json.dumps(_finite(asdict(self)), sort_keys=True, allow_nan=False).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Progress:
        """Parse and check a stored report; unknown fields are ignored (a newer writer). Raises
        :class:`InvalidProgressError`, and nothing else, for any value that is not a valid report."""
        if len(raw) > MAX_PROGRESS_BYTES:
            raise InvalidProgressError(f"a progress report of {len(raw)} bytes (at most {MAX_PROGRESS_BYTES})")
        try:
            data = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant, parse_float=_finite_float)
        except InvalidProgressError:
            raise
        except (ValueError, RecursionError) as exc:  # not UTF-8, not JSON, an int of too many digits, too deep
            raise InvalidProgressError(f"a progress report must be UTF-8 JSON: {_short(exc)}") from None
        if not isinstance(data, dict):
            raise InvalidProgressError(f"a progress report must be a JSON object, not {type(data).__name__}")
        return cls(
            step=_count(_required(data, "step"), "step"),
            world_size=_count(_required(data, "world_size"), "world_size", minimum=1),
            time=_time(data),
            total_steps=_optional_count(data, "total_steps"),
            loss=_loss(data),
            generation=_optional_count(data, "generation"),
            restart_count=_count(data.get("restart_count", 0), "restart_count"),
            checkpoint_step=_optional_count(data, "checkpoint_step"),
            checkpoint_path=_path(data),
            nodes=_nodes(data),
            extra=_extra(data),
        )


def _reject_constant(name: str) -> Any:
    raise InvalidProgressError(f"a progress report must be strict JSON: {name} is not a number")


def _finite_float(text: str) -> float:
    number = float(text)
    if not math.isfinite(number):  # 1e400
        raise InvalidProgressError(f"a progress report holds a number out of range: {text[:40]}")
    return number


def _short(exc: BaseException) -> str:
    text = str(exc)
    return text if len(text) <= 200 else text[:200] + "..."


def _short_repr(v: object) -> str:
    text = repr(v) if not isinstance(v, int) or abs(v) < 10**30 else f"a number of {len(str(abs(v)))} digits"
    return text if len(text) <= 60 else text[:60] + "..."


def _required(data: dict[str, Any], name: str) -> object:
    if name not in data:
        raise InvalidProgressError(f"progress field {name!r} is missing")
    return data[name]


def _count(v: object, name: str, minimum: int = 0) -> int:
    if type(v) is not int:
        raise InvalidProgressError(f"progress field {name!r} must be a whole number, not {type(v).__name__}")
    if not minimum <= v <= _MAX_INT:
        raise InvalidProgressError(f"progress field {name!r} must be within [{minimum}, 2**63), got {_short_repr(v)}")
    return v


def _optional_count(data: dict[str, Any], name: str) -> int | None:
    v = data.get(name)
    return None if v is None else _count(v, name)


def _number(v: object, name: str) -> float:
    if type(v) is not int and type(v) is not float:
        raise InvalidProgressError(f"progress field {name!r} must be a number, not {type(v).__name__}")
    try:
        number = float(v)
    except OverflowError:  # an int beyond any float
        raise InvalidProgressError(f"progress field {name!r} is out of range") from None
    if not math.isfinite(number):
        raise InvalidProgressError(f"progress field {name!r} must be finite")
    return number


def _time(data: dict[str, Any]) -> float:
    t = _number(_required(data, "time"), "time")
    if not 0.0 <= t < _MAX_TIME:
        raise InvalidProgressError(f"progress field 'time' must be seconds since 1970 before 9999, got {t!r}")
    return t


def _loss(data: dict[str, Any]) -> float | None:
    v = data.get("loss")
    return None if v is None else _number(v, "loss")


def _text(v: object, what: str, limit: int) -> str:
    if type(v) is not str:
        raise InvalidProgressError(f"{what} must be a string, not {type(v).__name__}")
    if len(v) > limit:
        raise InvalidProgressError(f"{what} has {len(v)} characters (at most {limit})")
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate ("\ud800" in the JSON): no one could write it back
        raise InvalidProgressError(f"{what} is not valid Unicode") from None
    return v


def _path(data: dict[str, Any]) -> str | None:
    v = data.get("checkpoint_path")
    return None if v is None else _text(v, "progress field 'checkpoint_path'", _MAX_PATH)


def _nodes(data: dict[str, Any]) -> list[str] | None:
    v = data.get("nodes")
    if v is None:
        return None
    if type(v) is not list:
        raise InvalidProgressError(f"progress field 'nodes' must be a list of names, not {type(v).__name__}")
    if len(v) > _MAX_NODES:
        raise InvalidProgressError(f"progress field 'nodes' lists {len(v)} nodes (at most {_MAX_NODES})")
    return [_text(n, "a name in progress field 'nodes'", _MAX_NODE_NAME) for n in v]


def _extra(data: dict[str, Any]) -> dict[str, Any]:
    v = data.get("extra", {})
    if type(v) is not dict:
        raise InvalidProgressError(f"progress field 'extra' must be an object, not {type(v).__name__}")
    _check_json(v, 0)
    return v


def _check_json(v: object, depth: int) -> None:
    """Strings valid Unicode, nesting bounded (numbers are finite already: NaN and Infinity are refused)."""
    if depth > _MAX_EXTRA_DEPTH:
        raise InvalidProgressError(f"progress field 'extra' is nested deeper than {_MAX_EXTRA_DEPTH}")
    if isinstance(v, str):
        _text(v, "a string in progress field 'extra'", MAX_PROGRESS_BYTES)
    elif isinstance(v, dict):
        for key, item in v.items():
            _text(key, "a key in progress field 'extra'", MAX_PROGRESS_BYTES)
            _check_json(item, depth + 1)
    elif isinstance(v, list):
        for item in v:
            _check_json(item, depth + 1)


def _finite(v: Any) -> Any:
    """``v`` with every non-finite float (NaN, infinities) replaced by None: strict JSON has none."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite(x) for x in v]
    return v


class ProgressReporter:
    """Publishes progress for the service. Contract: ``report`` never raises and never waits for etcd;
    ``close`` releases connections, waits a bounded time for the last report, and may be called twice."""

    def report(
        self,
        step: int,
        *,
        world_size: int,
        loss: float | None = None,
        total_steps: int | None = None,
        checkpoint_step: int | None = None,
        checkpoint_path: str | None = None,
        nodes: list[str] | None = None,
        force: bool = False,
        **extra: Any,
    ) -> None:
        """``nodes``: the round's node names; remembered, like the checkpoint, for later reports."""
        raise NotImplementedError

    def close(self, timeout: timedelta | None = None) -> None:
        raise NotImplementedError


class NullProgressReporter(ProgressReporter):
    """Used outside the service: drops every report."""

    def report(self, step: int, *, world_size: int, **kwargs: Any) -> None:
        return None

    def close(self, timeout: timedelta | None = None) -> None:
        return None


class EtcdProgressReporter(ProgressReporter):
    """Writes :class:`Progress` JSON to ``key`` from a background thread; remembers the last committed
    checkpoint across reports.

    ``report`` only puts the report in a one-value slot (the newest replaces an unwritten older one) and
    returns: microseconds, whatever etcd does. The writer thread writes the slot at most once per
    ``min_interval``, counted from the start of the previous attempt whether it succeeded or not; a forced
    report (a committed checkpoint) is written without waiting for the interval. A failed write keeps the
    report in the slot unless a newer one came, so the latest report lands once etcd answers again.
    ``close`` writes what is left in the slot, waiting at most ``close_timeout`` (etcd down: the report is
    dropped with a warning).
    """

    def __init__(
        self,
        client: EtcdClient,
        key: str,
        min_interval: timedelta = timedelta(seconds=1),
        generation: int | None = None,
        restart_count: int = 0,
        close_timeout: timedelta = timedelta(seconds=5),
    ) -> None:
        self._client = client
        self._key = key
        self._min_interval = min_interval.total_seconds()
        # after a failed write: wait at least this long before the next try (min_interval may be 0)
        self._retry_interval = max(self._min_interval, 0.2)
        self._close_timeout = close_timeout
        self._generation = generation
        self._restart_count = restart_count
        self._checkpoint: tuple[int | None, str | None] = (None, None)
        self._nodes: list[str] | None = None
        self._cond = threading.Condition(threading.Lock())
        # guarded by _cond:
        self._pending: Progress | None = None  # the latest report not written yet
        self._urgent = False  # the pending report was forced: no interval to wait
        self._next_write = 0.0  # time.monotonic() before which the interval holds the next write back
        self._closed = False  # close() was called: write what is pending, then stop
        self._abandoned = False  # close() stopped waiting: drop what is pending, close the client on exit
        self._done = False  # the writer thread left its loop
        # the writer thread's own:
        self._failing_since: float | None = None
        self._thread = threading.Thread(target=self._run, name=f"progress-writer {key}", daemon=True)
        self._thread.start()

    def report(
        self,
        step: int,
        *,
        world_size: int,
        loss: float | None = None,
        total_steps: int | None = None,
        checkpoint_step: int | None = None,
        checkpoint_path: str | None = None,
        nodes: list[str] | None = None,
        force: bool = False,
        **extra: Any,
    ) -> None:
        try:
            if nodes is not None:
                self._nodes = sorted(nodes)
            if checkpoint_step is not None:
                self._checkpoint = (checkpoint_step, checkpoint_path)
                force = True
            progress = Progress(
                step=step,
                world_size=world_size,
                time=time.time(),
                total_steps=total_steps,
                loss=loss,
                generation=self._generation,
                restart_count=self._restart_count,
                checkpoint_step=self._checkpoint[0],
                checkpoint_path=self._checkpoint[1],
                nodes=self._nodes,
                extra=extra,
            )
            with self._cond:
                if self._closed:
                    return
                # wake the writer only when it may be idle (nothing pending) or must not wait (forced)
                wake = self._pending is None or (force and not self._urgent)
                self._pending = progress
                self._urgent = self._urgent or force
                if wake:
                    self._cond.notify()
        except Exception:  # the contract: reporting never breaks training
            logger.exception("progress report dropped")

    def close(self, timeout: timedelta | None = None) -> None:
        """Write the last report (waiting at most ``timeout``, default ``close_timeout``), then release
        the etcd client. A second call does nothing."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify()
        limit = (timeout if timeout is not None else self._close_timeout).total_seconds()
        self._thread.join(limit)
        with self._cond:
            if not self._done:  # still writing (etcd unreachable): give up; the thread closes the client
                self._abandoned = True
                self._pending = None
                self._cond.notify()
                logger.warning("the last progress report was not written within %.1fs (etcd unreachable?)", limit)
                return
        self._client.close()

    # -- the writer thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                progress = self._next()
                if progress is None:
                    self._done = True
                    abandoned = self._abandoned
                    break
                self._next_write = time.monotonic() + self._min_interval  # whether the write succeeds or not
            written = self._write(progress)
            with self._cond:
                if not written:
                    self._next_write = time.monotonic() + self._retry_interval
                    if written is False and self._pending is None and not self._abandoned:
                        self._pending = progress  # retry it, unless a newer report came meanwhile
        if abandoned:
            self._client.close()

    def _next(self) -> Progress | None:
        """Wait (holding ``_cond``) for the next report to write; None: the reporter is closed and done."""
        while True:
            if self._abandoned:
                return None
            if self._pending is None:
                if self._closed:
                    return None
                self._cond.wait()
                continue
            wait = self._next_write - time.monotonic()
            failing = self._failing_since is not None
            if wait <= 0 or ((self._urgent or self._closed) and not failing):
                progress, self._pending, self._urgent = self._pending, None, False
                return progress
            self._cond.wait(wait)

    def _write(self, progress: Progress) -> bool | None:
        """True: written; False: etcd failed (retry); None: the report itself is unwritable (dropped)."""
        try:
            raw = progress.to_json()
            Progress.from_json(raw)  # what the controller would refuse is refused here, where it is made
        except (TypeError, ValueError) as exc:
            logger.warning("progress report dropped: %s", exc)
            return None
        try:
            self._client.put(self._key, raw)
        except EtcdError as exc:
            if self._failing_since is None:
                self._failing_since = time.monotonic()
                logger.warning("progress report not written, retrying with the latest report: %s", exc)
            else:
                logger.debug("progress report not written: %s", exc)
            return False
        except Exception:  # the writer thread must outlive any surprise
            logger.exception("progress report dropped")
            return None
        if self._failing_since is not None:
            logger.info("progress reports written again after %.1fs", time.monotonic() - self._failing_since)
            self._failing_since = None
        return True


def create_reporter(
    env: Mapping[str, str] | None = None, min_interval: timedelta = timedelta(seconds=1), rank: int | None = None
) -> ProgressReporter:
    """A reporter for this worker: writes only on rank 0 and only when the service configured a key.

    ``rank``: this worker's rank in the job (default ``$RANK``, which is node-local under live recovery,
    where the trainer passes the live group's rank)."""
    env = os.environ if env is None else env
    worker = WorkerEnv.from_environ(env)
    rank = int(env.get("RANK", "0")) if rank is None else rank
    if worker.job is None or worker.etcd is None or rank != 0:
        return NullProgressReporter()
    # short timeouts: they bound one write attempt of the writer thread (report() never waits for etcd)
    etcd = replace(worker.etcd, op_timeout=timedelta(seconds=5), request_timeout=timedelta(seconds=2))
    return EtcdProgressReporter(
        create_client(etcd.config()),
        worker.job.progress_key,
        min_interval=min_interval,
        generation=worker.job.generation,
        restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
    )
