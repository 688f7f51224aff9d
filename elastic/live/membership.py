"""A worker's membership in its job's live group, on etcd (the layout and decisions: :mod:`.protocol`).

:class:`LiveMembership` registers the worker under its own lease, and answers three questions, each with a
handful of etcd requests and a watch: *which generation do I join* (:meth:`join`: as a joiner, or by founding
one when none is live), *what is the next generation* after a failure or at a step boundary where joiners
wait (:meth:`reform`), and *is anyone waiting to join* (:meth:`joiners_waiting`, answered from a watch
without a request per step). It works on any :class:`~elastic.etcd.EtcdClient`, so the same code runs in
one process on the in-memory client in tests.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from datetime import timedelta

from elastic.etcd import (
    Compare,
    CompareOp,
    CompareTarget,
    DeleteOp,
    EtcdClient,
    EtcdError,
    GetOp,
    PutOp,
    TxnOp,
    TxnResult,
)
from elastic.etcd.api import EtcdLeaseNotFoundError
from elastic.etcd.lease import LeaseKeeper
from elastic.etcd.watch import RevisionWatcher
from elastic.live.protocol import (
    CommitNow,
    Generation,
    LiveKeys,
    LiveOptions,
    LiveProtocolError,
    ReformReason,
    WaitUntil,
    WorkerRecord,
    found_decision,
    next_members,
    reform_decision,
)

logger = logging.getLogger(__name__)

__all__ = [
    "JobFinishedError",
    "LiveMembership",
    "LiveSettings",
    "LiveTimeoutError",
    "MembershipError",
    "new_worker_id",
]


class MembershipError(RuntimeError):
    """The live group could not be reached or agreed on (etcd unreachable, a corrupt key)."""


class LiveTimeoutError(MembershipError):
    """No generation including this worker formed in time (the caller falls back to a restart)."""


class JobFinishedError(MembershipError):
    """The job finished before this worker was admitted: there is nothing left to train."""


def new_worker_id(node: str, local_rank: int) -> str:
    """A worker id unique across restarts: node, local rank, pid and a random suffix (no '/'). Ids in sorted
    order (a founded generation's rank order) keep each node's workers together, by local rank (zero-padded)."""
    safe = node.replace("/", "_") or "node"
    return f"{safe}-{local_rank:04d}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


#: The timings' defaults (their one home: :class:`~elastic.live.protocol.LiveOptions`).
_DEFAULTS = LiveOptions()


class LiveSettings:
    """The live group's size and timings (the timings are ``ElasticConfig(live=LiveOptions(...))``'s)."""

    def __init__(
        self,
        min_workers: int,
        max_workers: int,
        ttl: timedelta = _DEFAULTS.ttl,
        settle: timedelta = _DEFAULTS.settle,
        last_call: timedelta = _DEFAULTS.last_call,
        join_timeout: timedelta = _DEFAULTS.join_timeout,
        reform_timeout: timedelta = _DEFAULTS.reform_timeout,
        granularity: int = 1,
    ) -> None:
        if not 1 <= min_workers <= max_workers:
            raise ValueError(f"need 1 <= min_workers <= max_workers, got {min_workers}, {max_workers}")
        if granularity < 1:
            raise ValueError(f"granularity must be >= 1, got {granularity}")
        #: workers join in whole groups of this many (a sharded model's replica: see protocol.next_members)
        self.granularity = granularity
        self.min_workers, self.max_workers = min_workers, max_workers
        self.ttl, self.settle, self.last_call = ttl, settle, last_call
        self.join_timeout, self.reform_timeout = join_timeout, reform_timeout


class LiveMembership:
    """This worker's registration and its view of the group (see the module docstring)."""

    def __init__(self, client: EtcdClient, keys: LiveKeys, wid: str, settings: LiveSettings, node: str = "") -> None:
        if "/" in wid:
            raise ValueError(f"a worker id must not contain '/': {wid!r}")
        self._client, self._keys, self.wid, self.settings = client, keys, wid, settings
        self._record = WorkerRecord(wid, socket.gethostname(), os.getpid(), node)
        self._lock = threading.Lock()
        try:
            self._lease = LeaseKeeper(client, settings.ttl, on_new_lease=self._register, name=f"live-{wid}")
            _, revision = client.get(keys.gen)
        except EtcdError as exc:
            raise MembershipError(f"live group at {keys.base}: etcd unreachable ({exc})") from exc
        self._watch = RevisionWatcher(client, keys.membership, revision + 1)
        self._seen = -1  # the watch revision at which ``_registered`` was read
        self._registered: frozenset[str] = frozenset()
        self._joining: frozenset[str] = frozenset()
        self._closed = False

    # -- registration --------------------------------------------------------------------------------
    def _register(self, lease_id: int) -> None:
        self._client.put(self._keys.worker(self.wid), self._record.to_json(), lease=lease_id)

    def _lease_id(self) -> int:
        return self._lease.lease_id

    def close(self) -> None:
        """Leave: revoke the lease (the worker key and ready marks vanish at once)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._watch.close()
        self._lease.close(revoke=True)

    # -- reads ---------------------------------------------------------------------------------------
    def _txn(self, compare: list[Compare], success: list[TxnOp]) -> TxnResult:
        try:
            return self._client.txn(compare, success)
        except EtcdLeaseNotFoundError:
            self._lease.replace_lost(self._lease_id())  # re-registers; the caller's loop tries again
            raise
        except EtcdError as exc:
            raise MembershipError(f"live group at {self._keys.base}: {exc}") from exc

    def _snapshot(self, ready_gen: int | None = None) -> tuple[Generation | None, int, set[str], set[str], int]:
        """The generation (and its key's mod revision), the registered workers, the ready marks for
        ``ready_gen`` (None: the joiners), and the revision of the read."""
        ops: list[TxnOp] = [GetOp(self._keys.gen), GetOp(self._keys.workers, prefix=True, keys_only=True)]
        marks = self._keys.ready(ready_gen) if ready_gen is not None else self._keys.joiners
        ops.append(GetOp(marks, prefix=True, keys_only=True))
        ops.append(GetOp(self._keys.done, keys_only=True))
        res = self._txn([], ops)
        gen_read, workers_read, marks_read, done = res.reads()
        gen_kvs = gen_read.kvs
        gen, gen_rev = None, 0
        if gen_kvs:
            try:
                gen, gen_rev = Generation.from_json(gen_kvs[0].value), gen_kvs[0].mod_revision
            except LiveProtocolError as exc:
                raise MembershipError(f"{self._keys.gen}: {exc}") from exc
        workers = {kv.key[len(self._keys.workers) :] for kv in workers_read.kvs}
        marked = {kv.key[len(marks) :] for kv in marks_read.kvs}
        if done.kvs and ready_gen is None and (gen is None or gen.rank(self.wid) is None):
            raise JobFinishedError(f"live group at {self._keys.base}: the job finished")
        return gen, gen_rev, workers, marked, res.revision

    def finish(self) -> None:
        """Mark the job finished (a worker that comes later is told so instead of waiting)."""
        self._txn([], [PutOp(self._keys.done, b"1")])

    def _joiners(self) -> set[str]:
        res = self._txn([], [GetOp(self._keys.joiners, prefix=True, keys_only=True)])
        return {kv.key[len(self._keys.joiners) :] for kv in res.get(0).kvs}

    def current(self) -> Generation | None:
        return self._snapshot()[0]

    def _refresh(self) -> None:
        latest = self._watch.latest
        if latest > self._seen:
            try:
                _, _, workers, joining, revision = self._snapshot()
            except (MembershipError, EtcdError) as exc:
                logger.debug("live group: could not read the workers (%s)", exc)
                return
            with self._lock:
                self._registered, self._joining = frozenset(workers), frozenset(joining)
                self._seen = max(latest, revision)

    def joiners_waiting(self, gen: Generation) -> bool:
        """Whether a worker waits to be admitted into the generation after ``gen`` (etcd is read only when
        the watch saw a change)."""
        self._refresh()
        s = self.settings
        return len(next_members(gen, gen.members, self._joining, s.max_workers, s.granularity)) > len(gen.members)

    def alive(self) -> frozenset[str]:
        """The registered workers, as of the last change the watch saw."""
        self._refresh()
        return self._registered

    # -- decisions -----------------------------------------------------------------------------------
    def _commit(self, gen_rev: int, new: Generation) -> bool:
        """Replace the generation whose key had ``gen_rev`` (0: none) by ``new``; drop stores two back."""
        compare = [Compare(self._keys.gen, CompareTarget.MOD, CompareOp.EQUAL, gen_rev)]
        ops: list[TxnOp] = [PutOp(self._keys.gen, new.to_json())]
        res = self._txn(compare, ops)
        if res.succeeded:
            logger.info(
                "live group: generation %d committed (%s): %s", new.number, new.reason.value, ", ".join(new.members)
            )
            self._cleanup(new.number)
        return res.succeeded

    def _cleanup(self, number: int) -> None:
        try:
            old = number - 2
            if old >= 1:
                self._txn(
                    [], [DeleteOp(self._keys.gen_store(old), prefix=True), DeleteOp(self._keys.ready(old), prefix=True)]
                )
        except MembershipError:
            logger.debug("live group: could not clean generation %d's keys", number - 2, exc_info=True)

    def _wait(self, revision: int, timeout: float) -> None:
        self._watch.wait_beyond(revision, timedelta(seconds=max(timeout, 0.0)))

    def join(self) -> Generation:
        """Wait until a generation includes this worker: admitted by the live members at a step boundary,
        or founded with the other registered workers when no generation is live. Raises
        :class:`LiveTimeoutError` after ``join_timeout``."""
        s = self.settings
        deadline = time.monotonic() + s.join_timeout.total_seconds()
        min_reached: float | None = None
        marked = False
        while True:
            try:
                if not marked:
                    self._txn([], [PutOp(self._keys.joiner(self.wid), b"", lease=self._lease_id())])
                    marked = True
                gen, gen_rev, workers, joining, revision = self._snapshot()
            except EtcdLeaseNotFoundError:
                marked = False
                continue
            if gen is not None and gen.rank(self.wid) is not None:
                self._txn([], [DeleteOp(self._keys.joiner(self.wid))])
                return gen
            live = gen is not None and any(m in workers for m in gen.members)
            now = time.monotonic()
            wait = 1.0
            if not live:  # found one
                founders = sorted(w for w in joining if w in workers)
                if len(founders) >= s.min_workers:
                    min_reached = min_reached if min_reached is not None else now
                else:
                    min_reached = None
                since = timedelta(seconds=now - min_reached) if min_reached is not None else None
                decision = found_decision(founders, s.min_workers, s.max_workers, since, s.last_call, s.granularity)
                if isinstance(decision, CommitNow):
                    if decision.members[0] == self.wid:  # the first in id order commits; others wait for it
                        number = (gen.number + 1) if gen is not None else 1
                        self._commit(gen_rev, Generation(number, decision.members, ReformReason.FOUNDED))
                        continue
                    wait = s.last_call.total_seconds()  # if the first died meanwhile, look again
                elif isinstance(decision, WaitUntil):
                    wait = decision.after.total_seconds()
            if now >= deadline:
                raise LiveTimeoutError(
                    f"live group at {self._keys.base}: no generation took worker {self.wid} within {s.join_timeout}"
                )
            self._wait(revision, min(wait, deadline - now))

    def reform(self, gen: Generation, reason: ReformReason) -> Generation:
        """Ask for the generation after ``gen`` and return it (it may not include this worker: a member
        that came after the settle time joins the one after that, see :meth:`join`). With
        :attr:`ReformReason.ADMIT` every member asks at the same step boundary, so it commits without
        waiting; after a failure it waits for the live members, at most ``settle``."""
        s = self.settings
        target = gen.number + 1
        deadline = time.monotonic() + s.reform_timeout.total_seconds()
        first_seen: float | None = None
        marked = False
        while True:
            try:
                if not marked:
                    self._txn([], [PutOp(self._keys.ready_key(target, self.wid), b"", lease=self._lease_id())])
                    marked = True
                cur, gen_rev, workers, ready, revision = self._snapshot(target)
                joining = self._joiners()
            except EtcdLeaseNotFoundError:
                marked = False
                continue
            if cur is None:
                raise MembershipError(f"{self._keys.gen} vanished while re-forming generation {target}")
            if cur.number >= target:
                return cur
            now = time.monotonic()
            first_seen = first_seen if first_seen is not None else now
            since = timedelta(seconds=now - first_seen)
            decision = reform_decision(
                gen, ready, workers, since, s.settle, s.max_workers, joining, s.min_workers, s.granularity
            )
            if isinstance(decision, CommitNow):
                # the first ready member in rank order commits; the others wait for it (or take over once
                # it is gone: it is then neither ready nor alive)
                committer = next((m for m in gen.members if m in ready and m in workers), None)
                if committer == self.wid or committer is None:
                    self._commit(gen_rev, Generation(target, decision.members, reason))
                    continue
                wait = s.settle.total_seconds()
            else:
                wait = decision.after.total_seconds()
            if now >= deadline:
                raise LiveTimeoutError(
                    f"live group at {self._keys.base}: generation {target} did not form "
                    f"within {s.reform_timeout} (fewer than {s.min_workers} workers?)"
                )
            self._wait(revision, min(wait, deadline - now))
