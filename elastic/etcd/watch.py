"""One long-lived watch per prefix that many waiters can block on (no stream per wait)."""

from __future__ import annotations

import threading
from datetime import timedelta

from elastic.etcd.api import EtcdClient

__all__ = ["SHARED_WATCHERS", "RevisionWatcher", "SharedWatchers"]


class RevisionWatcher:
    """Tracks the newest revision at which a key under ``prefix`` changed.

    With ``is_prefix=False`` only the key ``prefix`` itself is watched.
    ``wait_beyond(revision, timeout)`` returns True as soon as a change newer than ``revision`` has been
    seen (at once if one already has), False after ``timeout``. The watch stream runs in a daemon thread
    and re-opens itself from the last delivered revision when it breaks.
    """

    def __init__(self, client: EtcdClient, prefix: str, start_revision: int, *, is_prefix: bool = True) -> None:
        self._latest = start_revision - 1
        self.start_revision = start_revision
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=client.watch_revisions,
            args=(prefix, start_revision, self._on_revision, self._stop),
            kwargs={"prefix": is_prefix},
            name=f"etcd-watch:{prefix}",
            daemon=True,
        )
        self._thread.start()

    def _on_revision(self, revision: int) -> None:
        with self._cond:
            if revision > self._latest:
                self._latest = revision
                self._cond.notify_all()

    @property
    def latest(self) -> int:
        """The newest revision at which a watched key changed (``start_revision - 1`` before any)."""
        with self._cond:
            return self._latest

    def wait_beyond(self, revision: int, timeout: timedelta) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._latest > revision, timeout.total_seconds())

    def close(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()


class SharedWatchers:
    """Reference-counted :class:`RevisionWatcher` objects, one per (client, prefix): handlers of one process
    that watch the same prefix (several simulated agents) share one stream instead of opening one each.

    ``acquire`` returns a watcher that has seen every change from ``start_revision`` on (an existing one
    started earlier qualifies: revisions are absolute); ``release`` closes it after its last user.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watchers: dict[tuple[int, str], tuple[RevisionWatcher, int]] = {}

    def acquire(self, client: EtcdClient, prefix: str, start_revision: int) -> RevisionWatcher:
        key = (id(client), prefix)
        with self._lock:
            found = self._watchers.get(key)
            if found is not None and found[0].start_revision <= start_revision:
                self._watchers[key] = (found[0], found[1] + 1)
                return found[0]
            watcher = RevisionWatcher(client, prefix, start_revision)
            if found is None:
                self._watchers[key] = (watcher, 1)
            return watcher

    def release(self, client: EtcdClient, prefix: str, watcher: RevisionWatcher) -> None:
        key = (id(client), prefix)
        with self._lock:
            found = self._watchers.get(key)
            if found is None or found[0] is not watcher:
                watcher.close()  # not shared
                return
            if found[1] > 1:
                self._watchers[key] = (watcher, found[1] - 1)
                return
            del self._watchers[key]
        watcher.close()


#: The process's shared watchers.
SHARED_WATCHERS = SharedWatchers()
