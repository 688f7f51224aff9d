"""The leader's :class:`ClusterView` kept between passes: one full read, then each pass reads only what changed.

A pass of the reconcile loop used to read every job, status, node, assignment, report and progress value
(megabytes at a thousand nodes, beyond gRPC's 4 MiB answer limit with a few thousand finished jobs) and parse
all of it. :class:`ViewCache` keeps, per key of the eight prefixes the view is made of, the mod revision and
the parsed value, plus the view derived from them, and brings them to a new revision in two steps:

1. One transaction at revision R: for each prefix believed unchanged since the cache's revision C, the
   compare ``every key under it has mod revision <= C`` and a count of its keys; for each prefix that may
   have changed (an etcd watch of the prefix saw a write after C: :class:`_ChangeHints`, only a hint), its
   keys and mod revisions without values (``keys_only``), ``list_page`` keys at a time (the rest in further
   requests at revision R). If a compare fails (the hint was late), the
   failure branch lists every prefix's keys instead; a count that differs (a key deleted, which no mod
   revision shows) makes the pass try again with that prefix listed.
2. The values of the keys whose mod revision differs from the cached one (new or rewritten), 128 per
   transaction, each guarded by ``mod revision == the one listed at R``: a value read so is the value at R.
   A key rewritten again since R fails the guard and the pass starts over (after three tries: a full read).
   Keys listed in 1 but gone from the listing are deleted from the cache.

So after a pass every cached key has exactly its value at R and no key exists at R that the cache lacks:
the view equals a full read at R (``tests/service/core/test_view_cache.py`` checks this against random
changes). A full read happens first, after :meth:`ViewCache.reset` (the controller calls it when it becomes
leader and after a failed pass), and when more than ``max_changed`` keys changed (cheaper read whole).
Unchanged values are never parsed again, and the view is derived key by key: a pass costs the keys of the
prefixes that changed (their listing) and the changed values, not the whole state.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from elastic.etcd import EtcdClient, KeyValue
from elastic.etcd.txn import Compare, CompareOp, CompareTarget, GetOp, GetResult
from service.core.keys import Keys
from service.core.view import ClusterView
from service.core.view_state import ViewState

logger = logging.getLogger(__name__)

__all__ = ["LIST_PAGE_KEYS", "ViewCache"]

_MAX_OPS = 128  # etcd's default --max-txn-ops: compares, and ops of one branch
#: keys per answer of a prefix's listing (keys only, under 100 bytes each): a listing of all eight prefixes stays
#: within gRPC's 4 MiB answer
LIST_PAGE_KEYS = 4_000


class _ChangeHints:
    """The newest revision at which each prefix was seen to change, from one watch per prefix (threads).

    Only a hint: a watch may lag behind a read, which the compares of the pass catch."""

    def __init__(self, client: EtcdClient, prefixes: Sequence[str], start_revision: int) -> None:
        self._latest = dict.fromkeys(prefixes, start_revision - 1)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        for prefix in prefixes:
            threading.Thread(
                target=self._watch,
                args=(client, prefix, start_revision),
                name=f"etrain-view-watch:{prefix}",
                daemon=True,
            ).start()

    def _watch(self, client: EtcdClient, prefix: str, start_revision: int) -> None:
        def seen(revision: int) -> None:
            with self._lock:
                self._latest[prefix] = max(self._latest[prefix], revision)

        try:
            client.watch_revisions(prefix, start_revision, seen, self._stop, prefix=True)
        except Exception:  # only hints: without them every prefix counts as changed
            logger.warning("the watch of %s stopped; its prefix is read every pass", prefix, exc_info=True)
            with self._lock:
                self._latest[prefix] = 1 << 62

    def changed_after(self, revision: int) -> set[str]:
        with self._lock:
            return {p for p, latest in self._latest.items() if latest > revision}

    def close(self) -> None:
        self._stop.set()


class ViewCache:
    """See the module docstring. Not thread-safe: one reconcile loop uses it."""

    def __init__(
        self,
        client: EtcdClient,
        keys: Keys,
        *,
        watch: bool = True,
        max_changed: int = 2048,
        on_read: Callable[[str, int], None] | None = None,
        prefixes: Sequence[str] | None = None,
        list_page: int = LIST_PAGE_KEYS,
    ) -> None:
        """``prefixes``: keep only these of the view's prefixes (default all; the view's other maps are empty).
        ``list_page``: keys per answer when a prefix is listed (its keys only)."""
        self._client = client
        self._list_page = max(1, list_page)
        self._keys = keys
        self._prefixes = list(prefixes) if prefixes is not None else ViewState.prefixes(keys)
        self._watch = watch
        self._max_changed = max_changed
        self._on_read = on_read  # (kind "full" | "incremental", keys fetched): for tests and metrics
        self._state: ViewState | None = None
        self._hints: _ChangeHints | None = None
        self._suspect: set[str] = set()  # prefixes whose count differed: list them next try
        # values known without reading them: the leader's own writes (a put's mod revision is its commit's),
        # and values read by a fetch that found them rewritten; used only for a key listed at that revision
        self._known: dict[str, KeyValue] = {}

    @property
    def revision(self) -> int:
        return self._state.revision if self._state is not None else 0

    def reset(self) -> None:
        """Forget everything: the next :meth:`read` is a full read."""
        self._state = None
        self._known.clear()

    def written(self, kvs: Sequence[KeyValue]) -> None:
        """Values this process wrote (key, value, and the revision of the write as ``mod_revision``): the next
        read takes them from here instead of etcd if the listing shows exactly that revision."""
        if self._state is not None:
            self._known.update((kv.key, kv) for kv in kvs)

    def close(self) -> None:
        self.reset()
        if self._hints is not None:
            self._hints.close()
            self._hints = None

    def read(self) -> ClusterView:
        if self._state is not None:
            for _ in range(3):
                if self._advance(self._state):
                    return self._state.view()
            logger.info("the cluster changed under three incremental reads in a row; reading it whole")
        return self._full().view()

    # -- reads ---------------------------------------------------------------------------------------
    def _rest_of_listing(self, prefix: str, first: GetResult, revision: int) -> list[KeyValue]:
        """The whole listing of ``prefix`` at ``revision`` whose first page is ``first``: no number of keys takes
        one answer past gRPC's 4 MiB (about 60 bytes a key: some 70,000 keys)."""
        kvs = list(first.kvs)
        left = first.count - len(kvs)
        while left > 0 and kvs:
            got = self._client.txn(
                [],
                [
                    GetOp(
                        prefix, prefix=True, keys_only=True, limit=self._list_page, after=kvs[-1].key, revision=revision
                    )
                ],
            ).get(0)
            if not got.kvs:
                break
            kvs += got.kvs
            left = got.count - len(got.kvs)
        return kvs

    def _full(self) -> ViewState:
        self._state = None
        prefixes = self._prefixes
        lists, revision = self._client.read_prefixes(prefixes)
        state = ViewState(self._keys, revision, prefixes)
        for kvs in lists:
            for kv in kvs:
                state.put(kv)
        self._state = state
        self._suspect.clear()
        if self._watch and self._hints is None:
            self._hints = _ChangeHints(self._client, prefixes, revision + 1)
        if self._on_read is not None:
            self._on_read("full", sum(map(len, lists)))
        return state

    def _advance(self, state: ViewState) -> bool:
        """Bring ``state`` to the current revision; False (nothing changed in ``state``) to try again."""
        prefixes = self._prefixes
        since = state.revision
        dirty = set(prefixes) if self._hints is None else self._hints.changed_after(since) | self._suspect
        clean = [p for p in prefixes if p not in dirty]
        listed = [p for p in prefixes if p in dirty]
        page = self._list_page
        result = self._client.txn(
            [Compare(p, CompareTarget.MOD, CompareOp.LESS, since + 1, prefix=True) for p in clean],
            [GetOp(p, prefix=True, count_only=True) for p in clean]
            + [GetOp(p, prefix=True, keys_only=True, limit=page) for p in listed],
            [GetOp(p, prefix=True, keys_only=True, limit=page) for p in prefixes],
        )
        listings: dict[str, list[KeyValue]] = {}
        if result.succeeded:
            for i, p in enumerate(clean):
                if result.get(i).count != state.count(p):  # a key deleted: only a listing shows which
                    self._suspect.add(p)
                    return False
            first = {p: result.get(len(clean) + i) for i, p in enumerate(listed)}
        else:
            first = {p: result.get(i) for i, p in enumerate(prefixes)}
        for p, head in first.items():  # a listing longer than a page goes on at the transaction's revision
            listings[p] = self._rest_of_listing(p, head, result.revision)
        changed: list[tuple[str, int]] = []
        deleted: list[str] = []
        for p, kvs in listings.items():
            mods = state.mods(p)
            listed_keys = set()
            for kv in kvs:
                listed_keys.add(kv.key)
                if mods.get(kv.key) != kv.mod_revision:
                    changed.append((kv.key, kv.mod_revision))
            deleted += [k for k in mods if k not in listed_keys]
        if len(changed) > self._max_changed:
            self._full()
            return True
        fetched: list[KeyValue] = []
        missing: list[tuple[str, int]] = []
        for key, mod in changed:
            known = self._known.get(key)
            if known is not None and known.mod_revision == mod:
                fetched.append(known)
            else:
                missing.append((key, mod))
        for i in range(0, len(missing), _MAX_OPS):
            chunk = missing[i : i + _MAX_OPS]
            gets = [GetOp(k) for k, _ in chunk]
            got = self._client.txn([Compare(k, CompareTarget.MOD, CompareOp.EQUAL, m) for k, m in chunk], gets, gets)
            values = [kv for j in range(len(chunk)) for kv in got.get(j).kvs]
            if not got.succeeded:  # some rewritten (or deleted) since the listing: start over, knowing these
                self._known.update((kv.key, kv) for kv in values)
                return False
            fetched += values
        for key in deleted:
            state.delete(key)
        for kv in fetched:
            state.put(kv)
        state.revision = result.revision
        self._suspect.clear()
        self._known = {k: kv for k, kv in self._known.items() if kv.mod_revision > state.revision}
        if self._on_read is not None:
            self._on_read("incremental", len(missing))
        return True
