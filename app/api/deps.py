"""FastAPI dependencies: what a route is served with, from the app's state."""

from __future__ import annotations

from fastapi import Request

from app.api.errors import APIError
from app.service.metrics import Metrics
from app.service.runtime import Runtime
from app.service.settings import Settings


def get_settings(request: Request) -> Settings:
    """The app's settings."""
    return request.app.state.settings


def get_metrics(request: Request) -> Metrics:
    """The app's metrics."""
    return request.app.state.metrics


def get_runtime(request: Request) -> Runtime:
    """The loaded runtime; 503 while the models are still loading or failed to load."""
    runtime: Runtime | None = request.app.state.runtime
    if runtime is None:
        error = request.app.state.load_error
        message = f"the model failed to load: {error}" if error else "the model is still loading; retry shortly"
        raise APIError("unavailable", message, {"Retry-After": "5"} if not error else None)
    return runtime
