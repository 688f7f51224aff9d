"""Request-scoped access to the app's store, settings and metrics (set by ``create_app``)."""

from __future__ import annotations

from fastapi import Request

from service.controller.loop import Controller
from service.controller.metrics import Metrics
from service.core.config import Settings
from service.core.store import ServiceStore

__all__ = ["get_controller", "get_metrics", "get_settings", "get_store"]


async def get_store(request: Request) -> ServiceStore:
    store: ServiceStore = request.app.state.store
    return store


async def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


async def get_metrics(request: Request) -> Metrics:
    metrics: Metrics = request.app.state.metrics
    return metrics


async def get_controller(request: Request) -> Controller:
    controller: Controller = request.app.state.controller
    return controller
