"""Operational endpoints: liveness and readiness (no token: probes), Prometheus metrics (a read token when
authentication is on: the metrics name every active job)."""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Response
from fastapi.responses import JSONResponse

from elastic.etcd import EtcdError
from service.api.auth import require_read
from service.api.deps import get_controller, get_metrics, get_settings, get_store
from service.controller.loop import Controller
from service.controller.metrics import CONTENT_TYPE, Metrics
from service.core.config import Settings
from service.core.store import ServiceStore

__all__ = ["router"]

router = APIRouter(tags=["system"])


@router.get("/healthz", summary="The process is up")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get(
    "/readyz",
    summary="etcd is reachable, a leader is known, and this replica's reconcile passes do not keep failing",
    responses={503: {"description": "not ready"}},
)
def readyz(
    store: Annotated[ServiceStore, Depends(get_store)],
    controller: Annotated[Controller, Depends(get_controller)],
    settings: Annotated[Settings, Depends(get_settings)],
) -> JSONResponse:
    body: dict[str, Any] = {"replica": settings.replica_id}
    try:
        store.client.ping(timeout=timedelta(seconds=2))
        body["etcd"] = "ok"
        leader = controller.election.leader()
    except EtcdError as exc:
        body.update(etcd=f"unreachable: {exc}", ready=False)
        return JSONResponse(body, status_code=503)
    body["leader"] = leader.get("replica") if leader else None
    body["is_leader"] = controller.election.is_leader
    body["ready"] = leader is not None or not settings.run_controller
    health = controller.health
    if health.failing:  # e.g. every read of the state failing: the API may answer, the service does not work
        body["reconcile"] = f"failing: {health.consecutive_failures} passes in a row, the last: {health.last_error}"
        body["ready"] = False
    elif settings.run_controller:
        body["reconcile"] = "ok"
    return JSONResponse(body, status_code=200 if body["ready"] else 503)


@router.get(
    "/metrics",
    summary="Prometheus metrics (a read token)",
    response_class=Response,
    dependencies=[Depends(require_read)],
)
def metrics(m: Annotated[Metrics, Depends(get_metrics)]) -> Response:
    return Response(m.render(), media_type=CONTENT_TYPE)
