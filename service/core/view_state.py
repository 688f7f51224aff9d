"""What the reconcile loop decides from, key by key: :class:`ViewState` turns the keys of the view's eight
prefixes into a :class:`ClusterView`, one key at a time.

Both reads of the view go through it, so they agree by construction: :meth:`ServiceStore.read_view` puts
every key of one read into a fresh state, and :class:`~service.core.view_cache.ViewCache` keeps one state
between passes and puts (or deletes) only the keys that changed. Each key is parsed when it is put, never
again while its mod revision stays the same, and the derived maps (jobs, nodes, assignments, reports,
progress, node controls) change only at the keys put or deleted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from elastic.etcd import KeyValue
from service.core.keys import Keys, at_own_key, load, load_progress, on_lease, tail
from service.core.models import Assignment, JobRecord, JobStatus, NodeControl, NodeInfo, WorkerReport
from service.core.view import ClusterView, JobEntry

__all__ = ["ViewState"]


class ViewState:
    """Every key of the view's prefixes at ``revision``: its mod revision, its parsed value, and the view."""

    def __init__(self, keys: Keys, revision: int = 0, prefixes: Sequence[str] | None = None) -> None:
        """``prefixes``: a part of :meth:`prefixes` only (the view's other maps stay empty)."""
        self.keys = keys
        self.revision = revision
        self._prefixes = list(prefixes) if prefixes is not None else self.prefixes(keys)
        self._mods: dict[str, dict[str, int]] = {p: {} for p in self._prefixes}  # prefix -> key -> mod revision
        self._parsed: dict[str, Any] = {}  # key -> what put() derived from it (None: unreadable)
        self._records: dict[str, JobRecord] = {}
        self._statuses: dict[str, tuple[JobStatus, int]] = {}
        self._cancels: set[str] = set()
        self._entries: dict[str, JobEntry] = {}
        self._nodes: dict[str, NodeInfo] = {}
        self._assignments: dict[str, dict[str, Assignment]] = {}
        self._reports: dict[str, dict[str, WorkerReport]] = {}
        self._progress: dict[str, Any] = {}
        self._controls: dict[str, NodeControl] = {}

    @staticmethod
    def prefixes(keys: Keys) -> list[str]:
        return [keys.jobs, keys.status, keys.cancel, keys.nodes, keys.assign, keys.reports, keys.progress, keys.nodectl]

    def _prefix_of(self, key: str) -> str:
        for p in self._prefixes:
            if key.startswith(p):
                return p
        raise ValueError(f"{key!r} is under none of the view's prefixes")

    def count(self, prefix: str) -> int:
        return len(self._mods[prefix])

    def mods(self, prefix: str) -> dict[str, int]:
        return self._mods[prefix]

    # -- changes -------------------------------------------------------------------------------------
    def put(self, kv: KeyValue) -> None:
        """The key ``kv.key`` now holds ``kv`` (new or rewritten)."""
        p = self._prefix_of(kv.key)
        if kv.key in self._mods[p]:
            self._forget(p, kv.key)
        self._mods[p][kv.key] = kv.mod_revision
        k = self.keys
        name = tail(kv, p)
        if p == k.jobs:
            rec = load(JobRecord, kv)
            if rec is not None and at_own_key(kv, rec.id, name):
                self._records[name] = rec
            self._entry(name)
        elif p == k.status:
            st = load(JobStatus, kv)
            if st is not None:
                self._statuses[name] = (st, kv.mod_revision)
            self._entry(name)
        elif p == k.cancel:
            self._cancels.add(name)
            self._entry(name)
        elif p == k.nodes:
            n = load(NodeInfo, kv)
            if n is not None and at_own_key(kv, n.name, name) and on_lease(kv):
                self._nodes[name] = n
        elif p == k.assign:
            node, _, job_id = name.partition("/")
            a = load(Assignment, kv)
            if a is not None and at_own_key(kv, a.job_id, job_id):
                self._assignments.setdefault(node, {})[job_id] = a
                self._parsed[kv.key] = (node, job_id)
        elif p == k.reports:
            r = load(WorkerReport, kv)
            if r is not None and at_own_key(kv, f"{r.node}/{r.job_id}", name):
                self._reports.setdefault(r.job_id, {})[r.node] = r
                self._parsed[kv.key] = (r.job_id, r.node)
        elif p == k.nodectl:
            c = load(NodeControl, kv)
            if c is not None and at_own_key(kv, c.name, name):
                self._controls[name] = c
        else:
            prog = load_progress(kv, name)
            if prog is not None:
                self._progress[name] = prog

    def delete(self, key: str) -> None:
        """The key no longer exists."""
        p = self._prefix_of(key)
        if key in self._mods[p]:
            self._forget(p, key)
            del self._mods[p][key]

    def _forget(self, p: str, key: str) -> None:
        """Undo what the key's earlier value put in the derived maps."""
        k = self.keys
        name = key[len(p) :]
        if p == k.jobs:
            self._records.pop(name, None)
            self._entry(name)
        elif p == k.status:
            self._statuses.pop(name, None)
            self._entry(name)
        elif p == k.cancel:
            self._cancels.discard(name)
            self._entry(name)
        elif p == k.nodes:
            self._nodes.pop(name, None)
        elif p == k.assign or p == k.reports:
            where = self._parsed.pop(key, None)
            if where is not None:
                table = self._assignments if p == k.assign else self._reports
                inner = table[where[0]]
                del inner[where[1]]
                if not inner:
                    del table[where[0]]
        elif p == k.nodectl:
            self._controls.pop(name, None)
        else:
            self._progress.pop(name, None)

    def _entry(self, job_id: str) -> None:
        rec, st = self._records.get(job_id), self._statuses.get(job_id)
        if rec is None or st is None:
            self._entries.pop(job_id, None)
        else:
            self._entries[job_id] = JobEntry(rec, st[0], st[1], job_id in self._cancels)

    # -- the view ------------------------------------------------------------------------------------
    def view(self) -> ClusterView:
        """The view at ``revision``: new maps (the state goes on changing), in key order like a read."""
        return ClusterView(
            jobs=dict(sorted(self._entries.items())),
            nodes=dict(sorted(self._nodes.items())),
            assignments={n: dict(sorted(jobs.items())) for n, jobs in sorted(self._assignments.items())},
            reports={j: dict(sorted(nodes.items())) for j, nodes in sorted(self._reports.items())},
            progress=dict(sorted(self._progress.items())),
            revision=self.revision,
            controls=dict(sorted(self._controls.items())),
        )
