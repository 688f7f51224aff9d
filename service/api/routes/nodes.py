"""``/v1/nodes``: the live node agents and what runs on them."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends

from service.api.auth import require_read
from service.api.deps import get_store
from service.api.schemas import NodeList, NodeView
from service.core.store import ServiceStore

__all__ = ["router"]

router = APIRouter(prefix="/v1", tags=["nodes"])


@router.get("/nodes", summary="Live nodes", dependencies=[Depends(require_read)])
def list_nodes(store: Annotated[ServiceStore, Depends(get_store)]) -> NodeList:
    nodes, assigned = store.list_nodes()
    entries = {e.record.id: e for e in store.list_jobs()}
    views = []
    for node in nodes:
        jobs = sorted(j for j in assigned.get(node.name, []) if j in entries)
        used = sum(
            entries[j].record.spec.nproc_per_node for j in jobs if not entries[j].status.state.terminal
        )
        views.append(NodeView(**node.model_dump(), jobs=jobs, free=node.capacity - used))
    return NodeList(nodes=views)
