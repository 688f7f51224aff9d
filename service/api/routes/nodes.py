"""``/v1/nodes``: the live node agents, what runs on them, and the operators' cordon / drain requests.

``POST /v1/nodes/{name}/cordon``: no new job is placed on the node; its jobs stay. ``.../drain``: cordoned, and
the leader moves its jobs off through planned scale-down (a snapshot first, never counted as a failure);
once no active job holds it the node shows as ``drained``. ``.../uncordon``: the request is deleted (the
node takes jobs again). A request may name a node that is not registered now (one about to join, or one
that left): it is kept in etcd (``<prefix>/nodectl/<name>``) until uncordoned, whatever the agent does.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Path

from service.api.auth import Principal, require_admin, require_read
from service.api.deps import get_store
from service.api.schemas import NodeControlRequest, NodeList, NodeOperation, NodeView
from service.core.models import NODE_NAME_PATTERN, Event, NodeControl, NodeMode, node_mode
from service.core.store import ServiceStore, new_event
from service.core.view import JobEntry

__all__ = ["node_views", "router"]

router = APIRouter(prefix="/v1", tags=["nodes"])

NodeName = Annotated[str, Path(pattern=NODE_NAME_PATTERN, description="the node's name (its agent's --node-name)")]
_Body = Annotated[NodeControlRequest | None, Body()]


def _active_jobs(job_ids: list[str], entries: dict[str, JobEntry]) -> list[str]:
    return [j for j in job_ids if not entries[j].status.state.terminal]


def node_views(store: ServiceStore) -> tuple[dict[str, NodeView], dict[str, list[str]]]:
    """Every live node and every node with a cordon / drain request (``live`` False if not registered), by
    name; and, per node, the active jobs assigned to it."""
    nodes, assigned = store.list_nodes()
    entries = {e.record.id: e for e in store.list_jobs()}
    controls = store.node_controls()
    views: dict[str, NodeView] = {}
    active: dict[str, list[str]] = {}
    for name in sorted({n.name for n in nodes} | set(controls)):
        jobs = sorted(j for j in assigned.get(name, []) if j in entries)
        active[name] = _active_jobs(jobs, entries)
        control = controls.get(name)
        fields: dict[str, Any] = {
            "jobs": jobs,
            "mode": node_mode(control, bool(active[name])),
            "reason": control.reason if control else None,
            "mode_requested_by": control.requested_by if control else None,
            "mode_since": control.at if control else None,
        }
        info = next((n for n in nodes if n.name == name), None)
        if info is not None:
            used = sum(entries[j].record.spec.nproc_per_node for j in active[name])
            views[name] = NodeView(**info.model_dump(), free=info.capacity - used, **fields)
        else:
            views[name] = NodeView(name=name, live=False, free=0, **fields)
    return views, active


@router.get(
    "/nodes", summary="Live nodes, and nodes with a cordon / drain request", dependencies=[Depends(require_read)]
)
def list_nodes(store: Annotated[ServiceStore, Depends(get_store)]) -> NodeList:
    views, _ = node_views(store)
    return NodeList(nodes=list(views.values()))


def _result(store: ServiceStore, name: str, changed: bool, message: str) -> NodeOperation:
    views, _ = node_views(store)
    view = views.get(name) or NodeView(name=name, live=False, free=0)
    if not view.live:
        message += " (no agent of this name is registered now: the request holds when one joins)"
    return NodeOperation(**view.model_dump(), changed=changed, message=message)


def _request(
    store: ServiceStore,
    name: str,
    mode: NodeMode,
    principal: Principal,
    body: NodeControlRequest | None,
    events: dict[str, Event] | None = None,
) -> tuple[bool, NodeControl | None]:
    """Store the request unless the node already has it (same mode, and no new reason); returns whether it
    was written and the request it replaced."""
    reason = body.reason if body is not None else None
    before = store.node_control(name)
    if before is not None and before.mode == mode and (reason is None or reason == before.reason):
        return False, before
    now = datetime.now(timezone.utc)
    store.set_node_control(
        NodeControl(name=name, mode=mode, requested_by=principal.name, at=now, reason=reason), events
    )
    return True, before


@router.post("/nodes/{name}/cordon", summary="Cordon a node: no new job is placed on it (its jobs stay)")
def cordon_node(
    name: NodeName,
    principal: Annotated[Principal, Depends(require_admin)],
    store: Annotated[ServiceStore, Depends(get_store)],
    body: _Body = None,
) -> NodeOperation:
    changed, before = _request(store, name, NodeMode.CORDONED, principal, body)
    if not changed:
        message = f"node {name} is already cordoned"
    elif before is not None and before.mode == NodeMode.DRAINING:
        message = f"node {name} cordoned (no longer draining: the jobs still on it stay)"
    else:
        message = f"node {name} cordoned"
    return _result(store, name, changed, message)


@router.post("/nodes/{name}/drain", summary="Drain a node: cordon it and move its jobs off (planned scale-down)")
def drain_node(
    name: NodeName,
    principal: Annotated[Principal, Depends(require_admin)],
    store: Annotated[ServiceStore, Depends(get_store)],
    body: _Body = None,
) -> NodeOperation:
    _, active = node_views(store)
    now = datetime.now(timezone.utc)
    why = f": {body.reason}" if body is not None and body.reason else ""
    text = f"node {name} is being drained by {principal.name}{why}: the job moves off it"
    events = {job_id: new_event("drain_requested", text, now, node=name) for job_id in active.get(name, [])}
    changed, _ = _request(store, name, NodeMode.DRAINING, principal, body, events)
    if not changed:
        message = f"node {name} is already draining"
    elif events:
        message = f"node {name} draining: {len(events)} active job(s) move off it ({', '.join(sorted(events))})"
    else:
        message = f"node {name} draining (no active job on it: drained)"
    return _result(store, name, changed, message)


@router.post("/nodes/{name}/uncordon", summary="Uncordon a node: delete its cordon / drain request")
def uncordon_node(
    name: NodeName,
    principal: Annotated[Principal, Depends(require_admin)],
    store: Annotated[ServiceStore, Depends(get_store)],
    body: _Body = None,
) -> NodeOperation:
    before = store.node_control(name)
    removed = store.clear_node_control(name)
    if removed:
        was = f" (was {before.mode.value})" if before is not None else ""
        message = f"node {name} uncordoned{was}: it takes new jobs again"
    else:
        message = f"node {name} had no cordon or drain request: nothing to do"
    return _result(store, name, removed, message)
