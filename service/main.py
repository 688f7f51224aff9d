"""The controller's ASGI app: ``create_app(settings)``; the reconcile loop runs for the app's lifetime.

OpenAPI docs are served at ``/docs`` (and ``/openapi.json``). Invalid request bodies get 422 with the
standard ``detail`` list (each entry's ``loc`` names the field) plus a one-line ``message``; etcd
trouble during a request gets 503.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request, Response
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

import elastic
from elastic.etcd import EtcdClient, EtcdError, create_client
from service.api.routes import jobs, nodes, system
from service.config import Settings
from service.controller import Controller, create_controller
from service.metrics import create_metrics
from service.store import create_store

logger = logging.getLogger(__name__)

__all__ = ["create_app"]


def _one_line(errors: list[dict[str, object]]) -> str:
    parts = []
    for err in errors:
        loc = [str(p) for p in err.get("loc", ()) if p not in ("body", "query", "path")]  # type: ignore[attr-defined]
        parts.append(f"{'.'.join(loc) or 'body'}: {err.get('msg')}")
    return "; ".join(parts)


def create_app(settings: Settings, client: EtcdClient | None = None) -> FastAPI:
    """Build the app; nothing connects until the first request or the app's start-up."""
    own_client = client is None
    etcd = client or create_client(settings.etcd.config())
    store = create_store(etcd, settings.prefix)
    metrics = create_metrics(store)
    controller: Controller = create_controller(store, settings, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if settings.tokens is None:
            logger.warning("no --tokens-file: API authentication is OFF (anyone reaching the port is admin)")
        if settings.run_controller:
            controller.start()
        try:
            yield
        finally:
            controller.stop(resign=True)
            if own_client:
                etcd.close()

    app = FastAPI(
        title="etrain",
        summary="Fault-tolerant elastic training jobs on stock torchrun",
        version=elastic.__version__,
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.store = store
    app.state.metrics = metrics
    app.state.controller = controller

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = jsonable_encoder(exc.errors())
        return JSONResponse({"detail": errors, "message": _one_line(errors)}, status_code=422)

    @app.exception_handler(EtcdError)
    async def _etcd_down(request: Request, exc: EtcdError) -> JSONResponse:
        logger.warning("%s %s: %s", request.method, request.url.path, exc)
        return JSONResponse({"detail": f"etcd unavailable: {exc}"}, status_code=503)

    @app.middleware("http")
    async def _count(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        started = time.monotonic()
        response = await call_next(request)
        route = getattr(request.scope.get("route"), "path", "unmatched")
        metrics.http_requests.labels(request.method, route, str(response.status_code)).inc()
        metrics.http_seconds.labels(route).observe(time.monotonic() - started)
        return response

    app.include_router(jobs.router)
    app.include_router(nodes.router)
    app.include_router(system.router)
    return app
