"""OpenAI-compatible HTTP API over a serving backend (FastAPI + uvicorn).

Routes: ``POST /v1/chat/completions`` and ``/v1/completions`` (``stream: true`` as server-sent events ending
with ``data: [DONE]``), ``GET /v1/models``, ``/health`` (liveness), ``/ready`` (the model is loaded and its
generation loop alive), ``/metrics`` (Prometheus text). Request and response bodies follow the OpenAI API;
every error is its envelope ``{"error": {"message", "type", "param", "code"}}``, with a 4xx status for
anything the client sent. Unknown fields are refused by name, never silently dropped. Generation runs on
the backend's own thread, so the event loop (and ``/health``) stays free under load; a client that goes away
cancels its generation.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.exceptions import HTTPException

from ladle.serve.backends import Backend
from ladle.serve.engine import Job

UNSUPPORTED = (
    "logprobs",
    "top_logprobs",
    "logit_bias",
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "response_format",
    "presence_penalty",
    "frequency_penalty",
    "best_of",
    "echo",
    "suffix",
)


@dataclass(frozen=True)
class Settings:
    """What the server was started with (``serve.*`` of the config)."""

    model: str
    max_new_tokens: int = 32
    api_key: str | None = None


class ApiError(Exception):
    """An error the client gets as the OpenAI envelope."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "developer"]
    content: str
    name: str | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class Sampling(BaseModel):
    """The sampling fields both endpoints share, as the OpenAI API names them."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("up to 4 non-empty stop strings")
        return stops


class CompletionRequest(Sampling):
    prompt: str


class ChatRequest(Sampling):
    messages: list[ChatMessage] = Field(min_length=1)


class Metrics:
    """The server's Prometheus metrics, in a registry of their own."""

    def __init__(self, backend: Backend):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("ladle_requests", "Requests by route and status.", ["route", "status"], registry=r)
        self.prompt_tokens = Counter("ladle_prompt_tokens", "Prompt tokens processed.", registry=r)
        self.completion_tokens = Counter("ladle_completion_tokens", "Completion tokens generated.", registry=r)
        self.cancelled = Counter("ladle_cancelled", "Generations cancelled because the client went away.", registry=r)
        buckets = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
        self.ttft = Histogram("ladle_time_to_first_token_seconds", "Time to first token.", buckets=buckets, registry=r)
        self.latency = Histogram("ladle_request_seconds", "Request latency.", buckets=buckets, registry=r)
        self.batch = Histogram(
            "ladle_batch_size", "Requests per generation batch.", buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r
        )
        depth = Gauge("ladle_queue_depth", "Requests waiting for a batch.", registry=r)
        depth.set_function(backend.queue_depth)


def create_app(backend: Backend, settings: Settings | str) -> FastAPI:
    """The API app serving ``backend`` (``settings``: a ``Settings``, or just the model id)."""
    settings = Settings(settings) if isinstance(settings, str) else settings
    app = FastAPI(title="ladle inference server")
    metrics = Metrics(backend)
    engine = getattr(backend, "engine", None)
    if engine is not None:
        engine.on_batch = metrics.batch.observe

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        metrics.requests.labels(request.url.path, str(exc.status)).inc()
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        return await api_error(request, validation_error(exc))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return await api_error(request, ApiError(exc.status_code, str(exc.detail), kind=kind))

    @app.exception_handler(Exception)
    async def crashed(request: Request, exc: Exception):
        return await api_error(request, ApiError(500, f"internal error: {type(exc).__name__}", kind="server_error"))

    @app.middleware("http")
    async def authorise(request: Request, call_next):
        open_paths = ("/health", "/ready", "/metrics")
        denied = request.headers.get("authorization", "") != f"Bearer {settings.api_key}"
        if settings.api_key and request.url.path not in open_paths and denied:
            message = "missing or wrong API key: send Authorization: Bearer <key>"
            return await api_error(request, ApiError(401, message, code="invalid_api_key", kind="authentication_error"))
        return await call_next(request)

    @app.get("/health")
    def health() -> dict:
        """Liveness: the process answers (no key needed)."""
        return {"status": "ok", "model": settings.model, "backend": backend.name}

    @app.get("/ready")
    def ready():
        """Readiness: 200 when the backend generates; 503 with the reason when its loop or model server is down
        (no key needed)."""
        if not backend.ready():
            raise ApiError(
                503,
                f"the {backend.name} backend is not serving (its generation loop or model server is down)",
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

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        """OpenAI's text completion (``prompt``), streamed as server-sent events with ``stream: true``."""
        return await serve(request, req, backend.encode(req.prompt), "text_completion", "cmpl")

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        """OpenAI's chat completion (``messages``, through the model's chat template), streamed as server-sent
        events with ``stream: true``."""
        messages = [m.model_dump(include={"role", "content"}) for m in req.messages]
        return await serve(request, req, backend.encode_chat(messages), "chat.completion", "chatcmpl")

    async def serve(request: Request, req: Sampling, ids: list[int], kind: str, prefix: str):
        job = make_job(req, ids, backend, settings)
        started, route = time.monotonic(), request.url.path
        events: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        job.emit = lambda event, data: loop.call_soon_threadsafe(events.put_nowait, (event, data))
        backend.submit(job)
        reply = Reply(f"{prefix}-{uuid.uuid4().hex}", kind, settings.model, int(time.time()))
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(
                stream(events, job, reply, include_usage, started, route), media_type="text/event-stream"
            )
        text, done = await collect(events, job)
        finished(done, started, route)
        return reply.whole(text, done)

    def finished(done: dict, started: float, route: str) -> None:
        metrics.requests.labels(route, "200").inc()
        metrics.prompt_tokens.inc(done["prompt_tokens"])
        metrics.completion_tokens.inc(done["completion_tokens"])
        metrics.latency.observe(time.monotonic() - started)

    async def events_of(events: asyncio.Queue, job: Job):
        """The job's events as they arrive, up to its ``done`` or ``error``; the first text times TTFT."""
        first = True
        while True:
            event, data = await events.get()
            if event == "text" and first:
                metrics.ttft.observe(time.monotonic() - job.submitted)
                first = False
            yield event, data
            if event != "text":
                return

    async def collect(events: asyncio.Queue, job: Job) -> tuple[str, dict]:
        pieces = []
        try:
            async for event, data in events_of(events, job):
                if event == "text":
                    pieces.append(data["text"])
                elif event == "error":
                    raise ApiError(500, f"generation failed: {data['message']}", kind="server_error")
                else:
                    return "".join(pieces), data
        except asyncio.CancelledError:  # the client went away: stop generating for it
            job.cancelled.set()
            metrics.cancelled.inc()
            raise

    async def stream(events, job: Job, reply: Reply, include_usage: bool, started: float, route: str):
        ended = False
        try:
            yield sse(reply.chunk({"role": "assistant", "content": ""} if reply.chat else ""))
            async for event, data in events_of(events, job):
                if event == "text":
                    yield sse(reply.chunk({"content": data["text"]} if reply.chat else data["text"]))
                elif event == "error":
                    ended = True
                    error = {"message": f"generation failed: {data['message']}", "type": "server_error"}
                    yield sse({"error": {**error, "param": None, "code": None}})
                    break
                else:
                    ended = True
                    yield sse(reply.chunk({} if reply.chat else "", data["finish_reason"]))
                    if include_usage:
                        yield sse({**reply.head(), "choices": [], "usage": usage(data)})
                    finished(data, started, route)
                    break
            yield "data: [DONE]\n\n"
        finally:
            if not ended:  # the client went away mid-stream
                job.cancelled.set()
                metrics.cancelled.inc()

    return app


@dataclass(frozen=True)
class Reply:
    """The OpenAI response objects of one request."""

    id: str
    kind: str  # chat.completion | text_completion
    model: str
    created: int

    @property
    def chat(self) -> bool:
        return self.kind == "chat.completion"

    def head(self, chunk: bool = True) -> dict:
        kind = self.kind + (".chunk" if chunk and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "system_fingerprint": None}

    def chunk(self, delta: Any, finish: str | None = None) -> dict:
        key = "delta" if self.chat else "text"
        return {**self.head(), "choices": [{"index": 0, key: delta, "logprobs": None, "finish_reason": finish}]}

    def whole(self, text: str, done: dict) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None}}
        else:
            choice = {"index": 0, "text": text}
        choice.update(logprobs=None, finish_reason=done["finish_reason"])
        return {**self.head(chunk=False), "choices": [choice], "usage": usage(done)}


def usage(done: dict) -> dict:
    prompt, completion = done["prompt_tokens"], done["completion_tokens"]
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def make_job(req: Sampling, ids: list[int], backend: Backend, settings: Settings) -> Job:
    """The engine's job for a validated request.

    Raises:
        ApiError: another model, ``n`` > 1, or a prompt and completion longer than the context.
    """
    if req.model not in (None, settings.model):
        raise ApiError(
            404,
            f"The model '{req.model}' does not exist; this server serves '{settings.model}'.",
            param="model",
            code="model_not_found",
            kind="not_found_error",
        )
    if req.seed is not None and not backend.supports_seed:
        raise ApiError(
            400,
            f"seed is not supported by the {backend.name} backend (it samples without per-request seeds). "
            "Leave it out, or serve with serve.backend=transformers.",
            param="seed",
            code="unsupported_parameter",
        )
    if req.n != 1:
        raise ApiError(400, f"n = {req.n}: only n=1 is supported; send n requests instead.", param="n")
    limit = req.max_completion_tokens or req.max_tokens or settings.max_new_tokens
    if len(ids) + limit > backend.context_length:
        raise ApiError(
            400,
            f"This model's maximum context length is {backend.context_length} tokens; the prompt "
            f"has {len(ids)} and max_tokens is {limit}. Shorten the prompt or lower max_tokens.",
            param="messages" if isinstance(req, ChatRequest) else "prompt",
            code="context_length_exceeded",
        )
    if backend.kv_tokens is not None and len(ids) + limit > backend.kv_tokens:
        raise ApiError(
            400,
            f"This server's KV cache holds {backend.kv_tokens} tokens across its batch (serve.kv_cache_tokens); "
            f"the prompt has {len(ids)} and max_tokens is {limit}. Shorten the prompt or lower max_tokens.",
            param="messages" if isinstance(req, ChatRequest) else "prompt",
            code="context_length_exceeded",
        )
    if not ids:
        raise ApiError(400, "the prompt is empty.", param="prompt")
    return Job(
        ids=ids,
        max_new_tokens=limit,
        temperature=req.temperature,
        top_p=req.top_p,
        seed=req.seed,
        stop=list(req.stop or []),
    )


def validation_error(exc: RequestValidationError) -> ApiError:
    """The first problem of a request that failed validation, as a 400 naming the field."""
    item = exc.errors()[0] if exc.errors() else {"msg": "invalid request", "loc": ()}
    loc = [str(p) for p in item.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if item.get("type") == "json_invalid":
        return ApiError(400, "We could not parse the JSON body of your request.", code="invalid_json")
    if item.get("type") == "extra_forbidden" and loc and loc[-1] in UNSUPPORTED:
        return ApiError(400, f"{loc[-1]} is not supported by this server.", param=param, code="unsupported_parameter")
    if item.get("type") == "extra_forbidden":
        return ApiError(400, f"Unrecognized request argument supplied: {param}", param=param, code="unknown_parameter")
    message = str(item.get("msg", "invalid value")).removeprefix("Value error, ")
    return ApiError(400, f"Invalid value for '{param}': {message}." if param else message, param=param)


def api_key_from_env(name: str | None) -> str | None:
    """The key named by ``serve.api_key_env`` (None: no key required).

    Raises:
        ValueError: the variable is named but not set (a server must never start open by accident).
    """
    if not name:
        return None
    key = os.environ.get(name)
    if not key:
        raise ValueError(
            f"serve.api_key_env = {name}: the environment variable {name} is not set. Set it, or "
            "set serve.api_key_env=null to serve without a key."
        )
    return key
