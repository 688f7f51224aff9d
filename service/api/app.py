"""The controller's ASGI app: ``create_app(settings)``; the reconcile loop runs for the app's lifetime.

OpenAPI docs are served at ``/docs`` (Swagger UI from the installed package, :mod:`service.api.docs`) and
``/openapi.json``; ReDoc is off. Invalid request bodies get 422 with the
standard ``detail`` list (each entry's ``loc`` names the field) plus a one-line ``message``; etcd
trouble during a request gets 503.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import elastic
from elastic.etcd import EtcdClient, EtcdError, create_client
from service.api import dashboard, docs
from service.api.admission import DEFAULT_MAX_BODY_BYTES, Admission, is_loopback_host
from service.api.routes import jobs, logs, nodes, system, trace
from service.controller.loop import Controller, create_controller
from service.controller.metrics import Metrics, create_metrics
from service.core.config import Settings
from service.core.store import create_store

logger = logging.getLogger(__name__)

__all__ = ["METHOD_LABELS", "create_app", "method_label"]


def _utf8(value: Any) -> Any:
    """``value`` with every string that UTF-8 cannot encode (a lone surrogate from a JSON ``\\ud800`` escape, quoted
    back in a validation error) written with backslash escapes: the 422 itself failed with a 500 before."""
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            return value.encode("utf-8", "backslashreplace").decode()
        return value
    if isinstance(value, dict):
        return {_utf8(k): _utf8(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_utf8(v) for v in value]
    return value


def _one_line(errors: list[dict[str, object]]) -> str:
    parts = []
    for err in errors:
        loc = [str(p) for p in err.get("loc", ()) if p not in ("body", "query", "path")]  # type: ignore[attr-defined]
        parts.append(f"{'.'.join(loc) or 'body'}: {err.get('msg')}")
    return "; ".join(parts)


#: the ``method`` labels of ``etrain_http_requests_total``: any other method (a client makes them up at will, each
#: would be a series of its own) is counted as ``other``
METHOD_LABELS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


def method_label(method: str) -> str:
    return method if method in METHOD_LABELS else "other"


class _RequestMetrics:
    """Counts requests by method, route and status, and times them (a plain ASGI middleware: Starlette's
    ``BaseHTTPMiddleware`` costs a task and a stream per request, a large share of a status read)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        status = 500

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")  # set by the router in this scope
            self.metrics.http_requests.labels(method_label(scope["method"]), route, str(status)).inc()
            self.metrics.http_seconds.labels(route).observe(time.monotonic() - started)


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
            metrics.close()
            if own_client:
                etcd.close()

    app = FastAPI(
        title="etrain",
        summary="Fault-tolerant elastic training jobs on stock torchrun",
        version=elastic.__version__,
        lifespan=lifespan,
        # /docs is service.api.docs (Swagger UI from the package, a strict CSP); FastAPI's pages load it and ReDoc
        # from a CDN onto the dashboard's origin, where the API token is kept
        docs_url=None,
        redoc_url=None,
        swagger_ui_oauth2_redirect_url=None,
    )
    app.state.settings = settings
    app.state.store = store
    app.state.metrics = metrics
    app.state.controller = controller

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = _utf8(jsonable_encoder(exc.errors()))
        return JSONResponse({"detail": errors, "message": _one_line(errors)}, status_code=422)

    @app.exception_handler(EtcdError)
    async def _etcd_down(request: Request, exc: EtcdError) -> JSONResponse:
        logger.warning("%s %s: %s", request.method, request.url.path, exc)
        return JSONResponse({"detail": f"etcd unavailable: {exc}"}, status_code=503)

    # auth off on loopback: only the machine reaches the port, so a web page in a local browser must not act for
    # its user (DNS rebinding, cross-site form posts)
    loopback_only = settings.tokens is None and is_loopback_host(settings.host)
    app.add_middleware(
        Admission, tokens=settings.tokens, max_body_bytes=DEFAULT_MAX_BODY_BYTES, loopback_only=loopback_only
    )
    app.add_middleware(_RequestMetrics, metrics=metrics)  # added last: outermost, it counts refusals too

    app.include_router(jobs.router)
    app.include_router(trace.router)
    app.include_router(logs.router)  # proxied to the node agents' log servers
    app.include_router(nodes.router)
    app.include_router(system.router)
    app.include_router(dashboard.router)  # /ui/: static pages that read the API above with the user's token
    app.include_router(docs.router)  # /docs: Swagger UI, its files from the package, no CDN
    return app
