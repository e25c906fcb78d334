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

import asyncio
import os
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from prometheus_client import generate_latest
from starlette.exceptions import HTTPException

from ladle.errors import LadleError
from ladle.serve.adapters import BaseWeights, Catalog
from ladle.serve.backends import Backend
from ladle.serve.guard import Guard
from ladle.serve.metrics import Metrics
from ladle.serve.routes import Generation
from ladle.serve.schema import AdapterRequest, ApiError, BindRequest, ClientGone, FeedbackRequest, validation_error
from ladle.serve.settings import Settings

__all__ = ["OPEN_PATHS", "ROUTES", "Settings", "admin_key_from_file", "api_key_from_env", "create_app"]

OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})
"""Routes a probe or a scraper reads without the API key."""


ROUTES = frozenset(
    {*OPEN_PATHS, "/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/adapters", "/v1/feedback", "/tokenize"}
)


def create_app(backend: Backend, settings: Settings | str, catalog: Catalog | None = None, sync=None) -> FastAPI:
    """The API app serving ``backend`` (``settings``: a ``Settings``, or just the model id), with the LoRA adapters
    of ``catalog`` beside its base (made here when the backend serves adapters), those bound to registered models
    kept current by ``sync`` (``ladle.serve.adapter_sync.RegistrySync``)."""
    settings = Settings(settings) if isinstance(settings, str) else settings
    if catalog is None:
        catalog = Catalog(
            settings.model, BaseWeights.of(backend.model_dir) if getattr(backend, "serves_adapters", False) else None
        )
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
        control=settings.control,
    )
    add_probe_routes(app, backend, settings, metrics, catalog, sync)
    add_adapter_routes(app, backend, catalog, sync, settings.adapter_sources)
    app.state.capture = recorder_for(settings, metrics)
    add_feedback_route(app, settings, app.state.capture)
    Generation(backend, settings, metrics, catalog, app.state.capture).add_to(app)
    return app


def recorder_for(settings: Settings, metrics: Metrics):
    """The server's capture (``serve.capture``), or None when it is off."""
    if not settings.capture.enabled:
        return None
    from ladle.serve.capture import Recorder

    url = settings.capture.url or str(Path.cwd() / "traffic")
    return Recorder(settings.capture, url, settings.model, settings.version, metrics)


def add_feedback_route(app: FastAPI, settings: Settings, recorder) -> None:
    """``POST /v1/feedback``: a score, a corrected answer and a comment for one answer of this server (the API
    key's, as generation; the front forwards it), kept beside the captured traffic."""
    from ladle.serve.capture import FeedbackRefused

    @app.post("/v1/feedback")
    async def feedback(body: FeedbackRequest) -> dict:
        """Keep a feedback for the answer `response_id`: `value` (true / false, or a score), `correction` (the
        answer it should have given), `rationale` (a comment), `source` (who judged). 404 for an id this server
        does not know, 409 for a second one where serve.capture.feedback is refuse, 413 for an oversize
        correction or comment; nothing is kept then."""
        if recorder is None:
            raise ApiError(
                404,
                "this server keeps no feedback (serve.capture.enabled = false).",
                code="capture_off",
                kind="not_found_error",
            )
        bounds = (
            ("correction", settings.capture.max_correction_chars),
            ("rationale", settings.capture.max_comment_chars),
        )
        for field, most in bounds:
            text = getattr(body, field)
            if text is not None and len(text) > most:
                raise ApiError(
                    413,
                    f"{field} has {len(text)} characters; this server keeps at most {most} "
                    f"(serve.capture.max_{'correction' if field == 'correction' else 'comment'}_chars).",
                    param=field,
                    code="too_long",
                )
        try:
            kept = recorder.feedback(body.model_dump(mode="json"))
        except FeedbackRefused as exc:
            kind = "not_found_error" if exc.status == 404 else "invalid_request_error"
            raise ApiError(exc.status, exc.message, param="response_id", code=exc.code, kind=kind) from None
        return {
            "object": "feedback",
            "response_id": body.response_id,
            "model": kept["model"],
            "version": kept["version"],
        }


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


def add_probe_routes(
    app: FastAPI, backend: Backend, settings: Settings, metrics: Metrics, catalog: Catalog, sync=None
) -> None:
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
        problems = dict(catalog.problems)  # a copy: the sync thread changes it meanwhile
        if problems:  # a version the registry names is not served here: this replica is not what it says
            named = "; ".join(f"{problem}" for problem in problems.values())
            raise ApiError(503, f"adapters not served as the registry says: {named}", kind="server_error")
        stalled = sync.stalled() if sync is not None else None
        if stalled:
            raise ApiError(503, stalled, kind="server_error")
        return {"status": "ready", "model": settings.model, "max_batch": backend.max_batch}

    @app.get("/metrics")
    def prometheus() -> Response:
        """Prometheus metrics (no key needed); listed below."""
        return Response(generate_latest(metrics.registry), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    def models() -> dict:
        """OpenAI's model list: the base, then each adapter by name and by ``name@version`` / ``name@alias``."""
        return {"object": "list", "data": catalog.listing()}


def add_adapter_routes(
    app: FastAPI, backend: Backend, catalog: Catalog, sync=None, sources: tuple[str, ...] = ()
) -> None:
    """``GET /v1/adapters`` (what is served), ``POST /v1/adapters`` (register a version: loaded on first use,
    without a restart), ``DELETE /v1/adapters/{name}`` (``?version=``), and for adapters bound to registered models
    ``POST /v1/adapters/bind`` (serve one more registered model's champion and challenger) and
    ``POST /v1/adapters/sync`` (read the registry's aliases now). The listing takes the API key, as generation does;
    the others are control routes (``ladle.serve.guard.Control``: the admin key), and ``POST /v1/adapters`` loads
    only from under one of ``sources`` (``--adapter-source``)."""

    @app.get("/v1/adapters")
    def listed() -> dict:
        """Each adapter with its versions, aliases, rank and targets, and the registry sync's state."""
        state = sync.state() if sync is not None else None
        return {"object": "list", "base": catalog.base_name, "data": catalog.described(), "registry": state}

    @app.post("/v1/adapters/sync")
    async def synced() -> dict:
        """Control: read the registry's aliases now; the sync's state."""
        if sync is None:
            raise ApiError(400, "no adapter of this server is bound to a registered model", code="no_bindings")
        return await asyncio.to_thread(sync.once)

    @app.post("/v1/adapters/bind")
    async def bind(body: BindRequest) -> dict:
        """Control: serve a registered model's champion and challenger as adapter `name` (kept in the bindings
        file), read from the registry now."""
        if sync is None:
            raise ApiError(
                400,
                "this server was started without --tracking-uri, so it cannot follow registered models",
                code="no_registry",
            )
        try:
            catalog.check_name(body.name)
            sync.bindings.add(body.name, body.registered_model)
        except LadleError as exc:
            raise ApiError(400, str(exc), param="name") from None
        return await asyncio.to_thread(sync.once)

    def tell_engine(version) -> None:
        backend.add_adapter(version.key, version.info.path, version.info.bytes)

    @app.post("/v1/adapters")
    async def add(body: AdapterRequest) -> dict:
        """Control: register one version of an adapter from under an `--adapter-source` (loaded on first use)."""
        try:
            check_source(body.path, sources)
            path = await asyncio.to_thread(adapter_folder, body.path)
            version, dropped = await asyncio.to_thread(
                catalog.add, body.name, str(path), body.version, body.aliases, body.default, tell_engine
            )
        except LadleError as exc:
            raise ApiError(400, str(exc), param="path", code="invalid_adapter") from None
        for key in dropped:
            backend.drop_adapter(key)
        return {
            "name": body.name,
            "version": version.label,
            "aliases": sorted(version.aliases),
            "rank": version.info.rank,
        }

    @app.delete("/v1/adapters/{name:path}")
    def remove(name: str, version: str | None = None) -> dict:
        """Control: stop serving an adapter (`?version=`: one version); running requests finish on it."""
        try:
            dropped = catalog.remove(name, version)
        except LadleError as exc:
            raise ApiError(404, str(exc), param="name", code="model_not_found") from None
        for key in dropped:
            backend.drop_adapter(key)
        return {"name": name, "version": version, "deleted": True}


def check_source(path: str, sources: tuple[str, ...]) -> None:
    """``path`` lies under one of the configured adapter sources (a local folder, or a store URL prefix).

    A local path is compared after resolving links and ``..`` (so no path climbs out of a source); a URL by its
    normalised prefix, ending at a ``/`` (``s3://team-a`` does not admit ``s3://team-a-evil``).

    Raises:
        LadleError: no source is configured, or ``path`` is under none of them.
    """
    from ladle.platform import storage

    if not sources:
        raise LadleError(
            f"path = {path}: this server loads adapters over HTTP from no source. Start it with --adapter-source "
            "PREFIX (a folder or store URL its adapters live under), or bind registered models instead."
        )
    for source in sources:
        if storage.is_local(source) and storage.is_local(path):
            root, wanted = storage.local_path(source).resolve(), storage.local_path(path).resolve()
            if wanted == root or root in wanted.parents:
                return
        elif not storage.is_local(source) and not storage.is_local(path):
            root = source.rstrip("/") + "/"
            if path.startswith(root) and "/../" not in path + "/" and "/./" not in path + "/":
                return
    raise LadleError(
        f"path = {path}: not under any adapter source of this server ({', '.join(sources)}). Put the adapter "
        "under one of them, or restart the server with another --adapter-source."
    )


def adapter_folder(path: str) -> Path:
    """A local folder for the adapter at ``path``: itself, or its copy when it is a URL of the artifact store.

    Raises:
        LadleError: the copy failed.
    """
    from ladle.assets import ladle_home
    from ladle.platform import storage

    if storage.is_local(path):
        return storage.local_path(path)
    try:
        return storage.current_copy(path, ladle_home() / "adapters")  # again when the files there changed
    except (OSError, ValueError) as exc:
        raise LadleError(f"adapter {path}: could not copy it from the artifact store: {exc}") from None


def admin_key_from_file(path: str | None) -> str | None:
    """The admin key in the first line of ``path`` (None: no file named).

    Raises:
        ValueError: the file is missing, empty, or readable by others than its owner.
    """
    if not path:
        return None
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--admin-key-file {path}: no such file. Write the admin key into it (mode 0600).")
    if file.stat().st_mode & 0o077:
        raise ValueError(f"--admin-key-file {path}: others can read it. chmod 600 {path}.")
    key = file.read_text(encoding="utf-8").strip().splitlines()[:1]
    if not key or len(key[0]) < 16:
        raise ValueError(f"--admin-key-file {path}: holds no key of 16 characters or more. Write one into it.")
    from ladle.platform import secrets

    secrets.register(key[0])
    return key[0]


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
