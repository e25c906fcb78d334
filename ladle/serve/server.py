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
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from starlette.exceptions import HTTPException

from ladle.serve import tools as tools_api
from ladle.serve.backends import Backend
from ladle.serve.engine import Job
from ladle.serve.guard import Guard, envelope
from ladle.serve.limits import ServeLimits

UNSUPPORTED = (
    "functions",
    "function_call",
    "best_of",
    "echo",  # chat has none; completions take it
    "suffix",
)


@dataclass(frozen=True)
class Settings:
    """What the server was started with (``serve.*`` of the config)."""

    model: str
    max_new_tokens: int = 32
    api_key: str | None = None
    limits: ServeLimits = field(default_factory=ServeLimits)


MIN_TEMPERATURE = 1e-4
"""Below this a request is answered greedily: its distribution is the argmax to float precision, and dividing
logits by a temperature near zero overflows to inf (a sampling error, not an answer)."""

OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})
"""Routes a probe or a scraper reads without the API key."""


class ApiError(Exception):
    """An error the client gets as the OpenAI envelope."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers

    def response(self) -> JSONResponse:
        body = envelope(self.message, self.kind, self.code, self.param)
        return JSONResponse(body, status_code=self.status, headers=self.headers)


class ClientGone(Exception):
    """The client hung up before its answer was ready; its generation was cancelled."""


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | None = None
    name: str | None = None
    tool_calls: list[tools_api.ToolCall] | None = Field(None, max_length=128)
    tool_call_id: str | None = None
    # What an assistant message from an OpenAI response carries besides; clients send the message back as they got
    # it (the SDK's own objects), so these are taken and not used.
    refusal: str | None = None
    annotations: list | None = None
    audio: dict | None = None
    function_call: None = Field(None, description="OpenAI's deprecated single call: send tool_calls instead.")

    @model_validator(mode="after")
    def _content(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content (only an assistant's tool calls may stand alone)")
        return self


MAX_TOP_LOGPROBS = 20
"""Alternatives one token's log-probability may come with."""

ECHO_LOGITS_BYTES = 512 * 2**20
"""The float32 logits one ``echo`` with ``logprobs`` may take: the prompt's tokens x the vocabulary."""

MAX_LOGIT_BIAS = 1024
"""Tokens one request may bias."""

ADJUSTMENTS = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "logit_bias": None}
"""The request fields that change a row's logits before it is sampled, and the value that leaves them alone."""


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema`` as the OpenAI API names it (the SDK's ``parse`` sends ``strict: true``;
    ladle enforces every schema it accepts, strict or not)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    json_schema: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs json_schema: {name, schema}")
        return self

    def for_grammar(self) -> dict:
        """The OpenAI shape ``ladle.serve.structured.grammar_of`` reads."""
        spec = self.json_schema
        schema = {"name": spec.name, "schema": spec.json_schema} if spec is not None else None
        return {"type": self.type, "json_schema": schema}


class Sampling(BaseModel):
    """The sampling fields both endpoints share, as the OpenAI API names them."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    # What a random generator takes (torch's manual_seed: a signed or unsigned 64-bit integer).
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    # Not in OpenAI's API; vLLM's and Hugging Face's (a seen token's logit divided by it where positive). At least
    # 0.01: a smaller one multiplies a logit past float32's range (a denormal one did, found by fuzzing).
    repetition_penalty: float = Field(1.0, ge=0.01, le=10.0)
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, value):
        if value is None:
            return value
        if len(value) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} tokens, got {len(value)}")
        for key, bias in value.items():
            if not (key.isascii() and key.isdigit()) or len(key) > 10:
                raise ValueError(f"keys are token ids (integers as strings), got {key[:20]!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"biases are -100..100, got {bias} for token {key}")
        return value

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("up to 4 non-empty stop strings")
        return stops


class CompletionRequest(Sampling):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="Text, or its token ids (what evaluation harnesses send); one prompt per request, as a list of "
        "one too."
    )
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value):
        if isinstance(value, list) and value and not isinstance(value[0], int):
            if len(value) != 1:
                raise ValueError(
                    f"{len(value)} prompts in one request: this server takes one prompt per request. Send each as "
                    "its own request (concurrent requests share the batch)."
                )
            value = value[0]
        if isinstance(value, list) and (not value or any(i < 0 for i in value)):
            raise ValueError("token ids must be a non-empty list of ids >= 0")
        return value

    @property
    def alternatives(self) -> int | None:
        """How many likeliest alternatives each token's log-probability comes with (None: no log-probabilities)."""
        return self.logprobs


class ChatRequest(Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[tools_api.Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | tools_api.NamedChoice | None = None
    parallel_tool_calls: bool | None = None

    @property
    def alternatives(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class Metrics:
    """The server's Prometheus metrics, in a registry of their own. Requests are labelled by route template
    (an unknown path is ``other``), so requests to random paths cannot grow the series without bound."""

    def __init__(self, backend: Backend, routes: frozenset[str]):
        self.routes = routes
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

    def count(self, path: str, status: int) -> None:
        route = path if path in self.routes else "other"
        self.requests.labels(route, str(status)).inc()


ROUTES = frozenset({*OPEN_PATHS, "/v1/models", "/v1/completions", "/v1/chat/completions"})


def create_app(backend: Backend, settings: Settings | str) -> FastAPI:
    """The API app serving ``backend`` (``settings``: a ``Settings``, or just the model id)."""
    settings = Settings(settings) if isinstance(settings, str) else settings
    app = FastAPI(title="ladle inference server")
    metrics = Metrics(backend, ROUTES)
    engine = getattr(backend, "engine", None)
    if engine is not None:
        engine.on_batch = metrics.batch.observe
    add_error_handlers(app, metrics)
    app.add_middleware(
        Guard,
        max_body_bytes=settings.limits.max_body_bytes,
        api_key=settings.api_key,
        open_paths=OPEN_PATHS,
        refused=metrics.count,
    )
    add_probe_routes(app, backend, settings, metrics)
    add_generation_routes(app, backend, settings, metrics)
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
            raise ApiError(503, f"the {backend.name} backend fails every step; restart it", kind="server_error")
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


def add_generation_routes(app: FastAPI, backend: Backend, settings: Settings, metrics: Metrics) -> None:
    """The OpenAI completion routes. Each request is bounded (``serve.limits``) before the work it bounds;
    tokenization runs off the event loop, so a long prompt never stalls ``/health``; the answer's HTTP status is
    known before any of it is sent (a request that waited too long is a 503, not a broken stream); and a client
    that hangs up, streaming or not, cancels its generation."""
    limits = settings.limits
    prompt_chars = limits.prompt_chars(backend.context_length)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        """OpenAI's text completion (``prompt``), streamed as server-sent events with ``stream: true``."""
        refuse_when_full()  # before any work on the request: tokenizing, decoding, compiling its grammar
        if isinstance(req.prompt, list):  # token ids: bounded by the context, then by the vocabulary
            check_prompt_tokens(len(req.prompt), backend.context_length)
            vocab = backend.vocab_size
            bad = next((i for i in req.prompt if i >= vocab), None) if vocab else None
            if bad is not None:
                raise ApiError(
                    400,
                    f"prompt: token id {bad} is outside this model's vocabulary (0..{vocab - 1}).",
                    param="prompt",
                )
            ids, req.prompt = req.prompt, await asyncio.to_thread(backend.decode, req.prompt)
        else:
            check_prompt_chars(len(req.prompt), prompt_chars, "prompt")
            ids = await asyncio.to_thread(backend.encode, req.prompt)
        return await serve(request, req, ids, "text_completion", "cmpl")

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        """OpenAI's chat completion (``messages``, through the model's chat template), streamed as server-sent
        events with ``stream: true``."""
        if len(req.messages) > limits.max_messages:
            raise ApiError(
                400,
                f"messages has {len(req.messages)} items; this server takes at most {limits.max_messages} "
                "(serve.limits.max_messages).",
                param="messages",
                code="too_many_messages",
            )
        check_prompt_chars(sum(len(m.content or "") for m in req.messages), prompt_chars, "messages")
        refuse_when_full()  # before any work on the request: its template, tokens and grammar
        # OpenAI's `developer` is the newer name of `system`, which chat templates know.
        messages = tools_api.template_messages(req.messages)
        tooling = tools_of(req, backend)
        listed = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        try:
            ids = await asyncio.to_thread(backend.encode_chat, messages, listed)
        except TemplateError as exc:  # the template refuses these turns (an order or role it does not take)
            raise ApiError(
                400,
                f"The model's chat template refused these messages: {exc}. Send turns it takes (e.g. user and "
                "assistant alternating, one system message first).",
                param="messages",
                code="invalid_messages",
            ) from None
        return await serve(request, req, ids, "chat.completion", "chatcmpl", tooling)

    def refuse_when_full() -> None:
        """429 with Retry-After while ``serve.limits.max_queue`` requests wait: checked before a request costs
        the server anything (a grammar's compilation is milliseconds to seconds of CPU)."""
        if backend.queue_depth() >= limits.max_queue:
            raise ApiError(
                429,
                f"{backend.queue_depth()} requests are waiting for this server (serve.limits.max_queue = "
                f"{limits.max_queue}); retry after a second.",
                code="queue_full",
                kind="rate_limit_error",
                headers={"Retry-After": "1"},
            )

    async def serve(
        request: Request, req: Sampling, ids: list[int], kind: str, prefix: str, tooling: Tooling | None = None
    ):
        refuse_when_full()  # again: the queue may have filled while this request was tokenized
        job = make_job(req, ids, backend, settings)
        job.constraint = await asyncio.to_thread(constraint_of, req, backend, tooling)
        started, route = time.monotonic(), request.url.path
        job.deadline = job.submitted + limits.queue_timeout_s
        events: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        job.emit = lambda event, data: loop.call_soon_threadsafe(events.put_nowait, (event, data))
        backend.submit(job)
        reply = Reply(f"{prefix}-{uuid.uuid4().hex}", kind, settings.model, int(time.time()))
        watcher = asyncio.create_task(watch_disconnect(request, job, events))
        try:
            first = await next_event(events)
            if first[0] == "text":  # the answer's first text: its time to first token
                metrics.ttft.observe(time.monotonic() - job.submitted)
            if req.stream:
                include_usage = bool(req.stream_options and req.stream_options.include_usage)
                watcher.cancel()  # from here the streaming response hears the hang-up
                echo = req.prompt if job.echo else None
                chunks = (
                    stream_calls(first, events, job, reply, include_usage, started, route, tooling)
                    if tooling is not None and tooling.parses
                    else stream(first, events, job, reply, include_usage, started, route, echo)
                )
                return StreamingResponse(chunks, media_type="text/event-stream")
            text, done, logprobs = await collect(first, events, job)
        finally:
            watcher.cancel()
        finished(done, started, route)
        if tooling is not None and tooling.parses:
            content, calls = tooling.format.parse(raw_text(backend, job, text))
            if calls:
                return reply.whole(content, {**done, "finish_reason": "tool_calls"}, logprobs, calls)
        if job.echo:  # the prompt as sent, then the answer; the prompt's tokens first in the log-probabilities
            text = req.prompt + text
            logprobs = None if logprobs is None else [*(job.prompt_logprobs or []), *logprobs]
        return reply.whole(text, done, logprobs)

    async def watch_disconnect(request: Request, job: Job, events: asyncio.Queue) -> None:
        """Cancel ``job`` when its client hangs up before the answer is sent (uvicorn keeps the handler running,
        so without this an abandoned request would generate to its end)."""
        while (await request.receive())["type"] != "http.disconnect":
            pass
        job.cancelled.set()
        metrics.cancelled.inc()
        events.put_nowait(("gone", {}))

    def finished(done: dict, started: float, route: str) -> None:
        metrics.count(route, 200)
        metrics.prompt_tokens.inc(done["prompt_tokens"])
        metrics.completion_tokens.inc(done["completion_tokens"])
        metrics.latency.observe(time.monotonic() - started)

    async def next_event(events: asyncio.Queue) -> tuple[str, dict]:
        """The job's next event; an error is raised as the status it carries (500 when none)."""
        event, data = await events.get()
        if event == "gone":
            raise ClientGone
        if event == "error":
            status = int(data.get("status", 500))
            message = data["message"] if status != 500 else f"generation failed: {data['message']}"
            headers = {"Retry-After": "1"} if status == 503 else None
            raise ApiError(status, message, code=data.get("code"), kind="server_error", headers=headers)
        return event, data

    async def collect(first: tuple[str, dict], events: asyncio.Queue, job: Job) -> tuple[str, dict, list | None]:
        pieces, logprobs, (event, data) = [], [], first
        try:
            while event == "text":
                pieces.append(data["text"])
                logprobs += data.get("logprobs", [])
                event, data = await next_event(events)
            logprobs += data.get("logprobs", [])
            return "".join(pieces), data, logprobs if job.logprobs is not None else None
        except asyncio.CancelledError:  # the server is going away under this request: stop generating for it
            job.cancelled.set()
            metrics.cancelled.inc()
            raise

    async def stream_calls(
        first, events, job: Job, reply: Reply, include_usage: bool, started: float, route: str, tooling: Tooling
    ):
        """A streamed answer that may be tool calls, as OpenAI streams one: the role, the content as it is
        written (``tools_api.ContentStream``: up to where a call may begin), then, once the answer is whole and
        parsed, the rest of the content, each call with its id, name and arguments, and the finish reason. Each
        token's log-probabilities ride with the content that holds it (those of held text with the last chunk)."""
        ended, (event, data) = False, first
        wanted = job.logprobs is not None
        split = tools_api.ContentStream(tooling.format, tools_api.tag_ids(tooling.format, backend_tokenizer()))
        held: list = []
        try:
            yield sse(reply.chunk({"role": "assistant", "content": ""}))
            try:
                while event == "text":
                    held += data.get("logprobs", []) if wanted else []
                    piece = split.feed(data["text"], job.tokens)
                    if piece:
                        yield sse(reply.chunk({"content": piece}, None, held if wanted else None))
                        held = []
                    event, data = await next_event(events)
            except ApiError as exc:
                ended = True
                yield stream_error(exc)
                yield "data: [DONE]\n\n"
                return
            ended, done = True, data
            held += done.get("logprobs", []) if wanted else []
            content, calls = tooling.format.parse(raw_text(backend, job, split.text))
            rest = split.rest(content if calls else split.text)
            if rest or held:
                yield sse(reply.chunk({"content": rest}, None, held if wanted else None))
            for index, call in enumerate(tools_api.openai_calls(calls)):
                yield sse(reply.chunk({"tool_calls": [{"index": index, **call}]}))
            yield sse(reply.chunk({}, "tool_calls" if calls else done["finish_reason"]))
            if include_usage:
                yield sse({**reply.head(), "choices": [], "usage": usage(done)})
            finished(done, started, route)
            yield "data: [DONE]\n\n"
        finally:
            if not ended:  # the client went away while the answer was streamed
                job.cancelled.set()
                metrics.cancelled.inc()

    def backend_tokenizer():
        return getattr(backend, "tokenizer", None)

    async def stream(
        first, events, job: Job, reply: Reply, include_usage: bool, started: float, route: str, echo: str | None
    ):
        ended, (event, data), offset = False, first, 0
        wanted = job.logprobs is not None
        try:
            if echo is None:
                yield sse(reply.chunk({"role": "assistant", "content": ""} if reply.chat else ""))
            else:  # completions' echo: the prompt first, with its tokens' log-probabilities when asked
                prompt = job.prompt_logprobs if wanted else None
                yield sse(reply.chunk(echo, None, prompt))
                offset = sum(len(e["token"]) for e in prompt or [])
            while True:
                logprobs = data.get("logprobs", []) if wanted else None
                if event == "text":
                    yield sse(
                        reply.chunk({"content": data["text"]} if reply.chat else data["text"], None, logprobs, offset)
                    )
                    offset += sum(len(e["token"]) for e in logprobs or [])
                else:
                    ended = True
                    yield sse(reply.chunk({} if reply.chat else "", data["finish_reason"], logprobs, offset))
                    if include_usage:
                        yield sse({**reply.head(), "choices": [], "usage": usage(data)})
                    finished(data, started, route)
                    break
                try:
                    event, data = await next_event(events)
                except ApiError as exc:  # the status line is sent: the error goes in the stream
                    ended = True
                    yield stream_error(exc)
                    break
            yield "data: [DONE]\n\n"
        finally:
            if not ended:  # the client went away mid-stream
                job.cancelled.set()
                metrics.cancelled.inc()


def check_prompt_tokens(tokens: int, context: int) -> None:
    """Refuse a prompt of token ids longer than the model's context before anything decodes it.

    Raises:
        ApiError: 400 naming ``prompt``.
    """
    if tokens > context:
        raise ApiError(
            400,
            f"The prompt has {tokens} token ids; this model's context is {context} tokens. Shorten the prompt.",
            param="prompt",
            code="prompt_too_long",
        )


def check_prompt_chars(chars: int, limit: int, param: str) -> None:
    """Refuse a prompt longer than ``limit`` characters before it is tokenized.

    Raises:
        ApiError: 400 naming ``param`` and ``serve.limits.max_prompt_chars``.
    """
    if chars > limit:
        raise ApiError(
            400,
            f"The prompt has {chars} characters; this server takes at most {limit} (serve.limits.max_prompt_chars). "
            "Shorten the prompt.",
            param=param,
            code="prompt_too_long",
        )


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

    def chunk(self, delta: Any, finish: str | None = None, logprobs: list[dict] | None = None, offset: int = 0) -> dict:
        key = "delta" if self.chat else "text"
        choice = {"index": 0, key: delta, "logprobs": self.logprobs(logprobs, offset), "finish_reason": finish}
        return {**self.head(), "choices": [choice]}

    def whole(self, text: str | None, done: dict, logprobs: list[dict] | None = None, calls: list | None = None):
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None}}
            if calls:
                choice["message"]["tool_calls"] = tools_api.openai_calls(calls)
        else:
            choice = {"index": 0, "text": text}
        choice.update(logprobs=self.logprobs(logprobs), finish_reason=done["finish_reason"])
        return {**self.head(chunk=False), "choices": [choice], "usage": usage(done)}

    def logprobs(self, entries: list[dict] | None, offset: int = 0) -> dict | None:
        """OpenAI's ``logprobs`` object: chat's ``content`` list, or the completions API's parallel lists
        (``text_offset``: where each token's text starts in the completion, from ``offset``)."""
        if entries is None:
            return None
        if self.chat:
            return {"content": entries, "refusal": None}
        offsets = []
        for entry in entries:
            offsets.append(offset)
            offset += len(entry["token"])
        return {
            "tokens": [e["token"] for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [
                None if e["top_logprobs"] is None else {alt["token"]: alt["logprob"] for alt in e["top_logprobs"]}
                for e in entries
            ],
            "text_offset": offsets,
        }


def usage(done: dict) -> dict:
    prompt, completion = done["prompt_tokens"], done["completion_tokens"]
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def stream_error(exc: ApiError) -> str:
    """An error after the status line was sent: it goes in the stream, as OpenAI's streams carry one."""
    return sse(envelope(exc.message, exc.kind, exc.code, exc.param))


def not_on_backend(field: str, backend: Backend, why: str) -> ApiError:
    """The 400 for a request field ``backend`` cannot honour: the field, the backend, why, and the fix."""
    return ApiError(
        400,
        f"{field} is not supported by the {backend.name} backend (serve.backend={backend.name} {why}). Leave it "
        "out, or serve with serve.backend=transformers.",
        param=field,
        code="unsupported_parameter",
    )


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
        raise not_on_backend("seed", backend, "samples without per-request seeds")
    if req.n != 1:
        raise ApiError(400, f"n = {req.n}: only n=1 is supported; send n requests instead.", param="n")
    if getattr(req, "top_logprobs", None) is not None and not req.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true.", param="top_logprobs")
    if req.alternatives is not None and not backend.supports_logprobs:
        raise not_on_backend("logprobs", backend, "returns text, not per-token log-probabilities")
    if getattr(req, "echo", False) and req.alternatives is not None and backend.vocab_size is not None:
        size = len(ids) * backend.vocab_size * 4
        if size > ECHO_LOGITS_BYTES:
            longest = ECHO_LOGITS_BYTES // (backend.vocab_size * 4)
            raise ApiError(
                400,
                f"echo with logprobs scores every prompt token: this prompt's {len(ids)} tokens need "
                f"{size / 2**20:.0f} MiB of logits; this server scores prompts of up to {longest} tokens. Shorten "
                "the prompt or leave out echo.",
                param="echo",
            )
    for name, neutral in ADJUSTMENTS.items():
        if getattr(req, name) not in (neutral, {}) and not backend.adjusts_logits:
            raise not_on_backend(name, backend, "samples by temperature and top_p only")
    bias = {int(k): float(v) for k, v in (req.logit_bias or {}).items()}
    outside = sorted(k for k in bias if backend.vocab_size is not None and k >= backend.vocab_size)
    if outside:
        raise ApiError(
            400,
            f"logit_bias names token {outside[0]}, outside this model's vocabulary of {backend.vocab_size} tokens.",
            param="logit_bias",
        )
    limits = settings.limits
    asked = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
    limit = req.max_completion_tokens or req.max_tokens or settings.max_new_tokens
    if limit > limits.max_tokens:
        raise ApiError(
            400,
            f"{asked} is too large: {limit}. This server generates at most {limits.max_tokens} tokens per request "
            "(serve.limits.max_tokens).",
            param=asked,
            code="max_tokens_too_large",
        )
    long_stop = next((s for s in req.stop or [] if len(s) > limits.max_stop_chars), None)
    if long_stop is not None:
        raise ApiError(
            400,
            f"A stop string has {len(long_stop)} characters; this server takes stop strings of at most "
            f"{limits.max_stop_chars} (serve.limits.max_stop_chars).",
            param="stop",
            code="stop_too_long",
        )
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
        temperature=req.temperature if req.temperature >= MIN_TEMPERATURE else 0.0,
        top_p=req.top_p,
        seed=req.seed,
        stop=list(req.stop or []),
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty,
        logit_bias=bias,
        logprobs=req.alternatives,
        echo=bool(getattr(req, "echo", False)),
    )


@dataclass(frozen=True)
class Tooling:
    """A chat request's tools as served: the model's call format, and the tools one call must come from (None:
    the model decides; empty: ``tool_choice: none``)."""

    format: tools_api.Format
    forced: list | None

    @property
    def parses(self) -> bool:
        """The answer is read for calls (every choice but ``none``)."""
        return self.forced is None or bool(self.forced)


def tools_of(req: ChatRequest, backend: Backend) -> Tooling | None:
    """How ``req``'s tools are served (None: it has none).

    Raises:
        ApiError: the model's template cannot render them, ``tool_choice`` names an unknown function or comes
            without tools.
    """
    if not req.tools:
        if req.tool_choice not in (None, "none", "auto"):
            raise ApiError(400, "tool_choice needs tools: list the functions it may call.", param="tool_choice")
        return None
    from ladle.serve.structured import MAX_SCHEMA_CHARS

    size = len(json.dumps([t.model_dump(exclude_none=True) for t in req.tools]))
    if size > MAX_SCHEMA_CHARS:  # rendered into the prompt and, when forced, compiled into a grammar
        raise ApiError(
            400,
            f"tools is {size} characters of JSON; this server takes at most {MAX_SCHEMA_CHARS} (the functions' "
            "names, descriptions and parameter schemas together). Send fewer or smaller functions.",
            param="tools",
            code="tools_too_large",
        )
    try:
        fmt = tools_api.format_of(getattr(getattr(backend, "tokenizer", None), "chat_template", None))
        return Tooling(fmt, tools_api.chosen(req.tools, req.tool_choice))
    except tools_api.ToolError as exc:
        raise ApiError(400, f"{exc}.", param=exc.param, code="unsupported_tools") from None


def raw_text(backend: Backend, job: Job, text: str) -> str:
    """The answer with its special tokens (a tool-call tag may be one), where the backend has its tokens."""
    tokenizer = getattr(backend, "tokenizer", None)
    if tokenizer is None or not job.tokens:
        return text
    return tokenizer.decode(job.tokens, skip_special_tokens=False)


def constraint_of(req: Sampling, backend: Backend, tooling: Tooling | None = None):
    """The grammar ``req.response_format`` or a forced tool call asks for, as a matcher for its row (None: free
    text).

    Raises:
        ApiError: the backend cannot mask tokens, or the schema cannot be enforced (naming the part).
    """
    fmt = req.response_format
    wants_format = fmt is not None and fmt.type != "text"
    forced = tooling.forced if tooling is not None else None
    if not wants_format and not forced:
        return None
    field = "response_format" if wants_format else "tool_choice"
    if wants_format and forced:
        raise ApiError(
            400, "response_format with a required or named tool_choice: an answer is one or the other.", param=field
        )
    if not backend.constrains_output:
        raise not_on_backend(field, backend, "samples without per-request token masks")
    from ladle.serve.structured import GrammarError, grammar_of, lark_grammar

    try:
        if forced:
            special = set(getattr(backend.tokenizer, "all_special_tokens", []))
            grammar = lark_grammar(tooling.format.grammar(forced, special), "tools")
        else:
            grammar = grammar_of(fmt.for_grammar())
        return backend.grammars().constraint(grammar) if grammar is not None else None
    except GrammarError as exc:
        param = exc.param if wants_format else "tools"
        raise ApiError(400, f"Invalid {field}: {exc}.", param=param, code=f"invalid_{field}") from None


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
    if key:
        from ladle.platform import secrets

        secrets.register(key)  # masked in whatever this process logs, whatever the variable is called
    if not key:
        raise ValueError(
            f"serve.api_key_env = {name}: the environment variable {name} is not set. Set it, or "
            "set serve.api_key_env=null to serve without a key."
        )
    return key
