"""OpenAI-compatible HTTP API over a serving backend (FastAPI + uvicorn).

Routes: ``POST /v1/chat/completions`` and ``/v1/completions`` (``stream: true`` as server-sent events ending
with ``data: [DONE]``), ``GET /v1/models``, ``/health`` (liveness), ``/ready`` (the model is loaded and its
generation loop alive), ``/metrics`` (Prometheus text). Request and response bodies follow the OpenAI API;
every error is its envelope ``{"error": {"message", "type", "param", "code"}}``, with a 4xx status for
anything the client sent. Unknown fields are refused by name, never silently dropped. A server started by
``python -m ladle.serve`` runs its engine in a process of its own (``ladle.serve.client``), so the event loop
(and ``/health``) stays free under load; a client that goes away cancels its generation.

The modules by concern: ``schema`` (request bodies and errors), ``jobs`` (a request's bounds, tools and grammar
made into the engine's job), ``routes`` (the completion routes), ``replies`` (response objects and streams),
``metrics``, ``settings``; this one assembles the app and its probes.
"""

from __future__ import annotations

import os

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from prometheus_client import generate_latest
from starlette.exceptions import HTTPException

from ladle.serve.backends import Backend
from ladle.serve.guard import Guard
from ladle.serve.metrics import Metrics
from ladle.serve.routes import Generation
from ladle.serve.schema import ApiError, ClientGone, validation_error
from ladle.serve.settings import Settings

__all__ = ["OPEN_PATHS", "ROUTES", "Settings", "api_key_from_env", "create_app"]

OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})
"""Routes a probe or a scraper reads without the API key."""


ROUTES = frozenset({*OPEN_PATHS, "/v1/models", "/v1/completions", "/v1/chat/completions"})


def create_app(backend: Backend, settings: Settings | str) -> FastAPI:
    """The API app serving ``backend`` (``settings``: a ``Settings``, or just the model id)."""
    settings = Settings(settings) if isinstance(settings, str) else settings
    app = FastAPI(title="ladle inference server")
    metrics = Metrics(backend, ROUTES)
    backend.report_batches(metrics.batch.observe)
    add_error_handlers(app, metrics)
    app.add_middleware(
        Guard,
        max_body_bytes=settings.limits.max_body_bytes,
        api_key=settings.api_key,
        open_paths=OPEN_PATHS,
        refused=metrics.count,
    )
    add_probe_routes(app, backend, settings, metrics)
    Generation(backend, settings, metrics).add_to(app)
    return app


def add_error_handlers(app: FastAPI, metrics: Metrics) -> None:
    """Every error as the OpenAI envelope, counted by route template."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        metrics.count(request.url.path, exc.status)
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        return await api_error(request, validation_error(exc))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return await api_error(request, ApiError(exc.status_code, str(exc.detail), kind=kind))

    @app.exception_handler(ClientGone)
    async def gone(request: Request, exc: ClientGone):
        metrics.count(request.url.path, 499)  # nginx's "client closed request": nobody reads this answer
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def crashed(request: Request, exc: Exception):
        return await api_error(request, ApiError(500, f"internal error: {type(exc).__name__}", kind="server_error"))


def add_probe_routes(app: FastAPI, backend: Backend, settings: Settings, metrics: Metrics) -> None:
    """Liveness, readiness, metrics and the model list. The probes run on the event loop itself (they only read
    flags): no hop through a thread pool that a burst of requests may have filled."""

    @app.get("/health")
    async def health() -> dict:
        """Liveness: the process answers and its engine is not failing every step (no key needed); 503 when it
        is, so a supervisor or Kubernetes replaces the process."""
        if not backend.live():
            why = getattr(backend, "dead", None) or f"the {backend.name} backend fails every step; restart it"
            raise ApiError(503, why, kind="server_error")
        return {"status": "ok", "model": settings.model, "backend": backend.name}

    @app.get("/ready")
    async def ready():
        """Readiness: 200 when the backend generates; 503 with the reason when its loop or model server is down
        or every step fails (no key needed)."""
        if not backend.ready():
            raise ApiError(
                503,
                f"the {backend.name} backend is not serving (its generation loop or model server is down, or "
                "every step fails)",
                kind="server_error",
            )
        return {"status": "ready", "model": settings.model, "max_batch": backend.max_batch}

    @app.get("/metrics")
    def prometheus() -> Response:
        """Prometheus metrics (no key needed); listed below."""
        return Response(generate_latest(metrics.registry), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    def models() -> dict:
        """OpenAI's model list: the one model served."""
        return {
            "object": "list",
            "data": [{"id": settings.model, "object": "model", "created": 0, "owned_by": "ladle"}],
        }


def api_key_from_env(name: str | None) -> str | None:
    """The key named by ``serve.api_key_env`` (None: no key required).

    Raises:
        ValueError: the variable is named but not set (a server must never start open by accident).
    """
    if not name:
        return None
    key = os.environ.get(name)
    if key:
        from ladle.platform import secrets

        secrets.register(key)  # masked in whatever this process logs, whatever the variable is called
    if not key:
        raise ValueError(
            f"serve.api_key_env = {name}: the environment variable {name} is not set. Set it, or "
            "set serve.api_key_env=null to serve without a key."
        )
    return key
