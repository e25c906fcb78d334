"""The OpenAI completion routes of a model server: a request bounded, made into a job, submitted to the
backend, and its events answered whole or streamed.

Each request is bounded (``serve.limits``) before the work it bounds; tokenization runs off the event loop, so a
long prompt never stalls ``/health``; the answer's HTTP status is known before any of it is sent (a request that
waited too long is a 503, not a broken stream); and a client that hangs up, streaming or not, cancels its
generation.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from jinja2 import TemplateError

from ladle.serve import capture as capture_api
from ladle.serve import tools as tools_api
from ladle.serve.adapters import PINNED_HEADER, Catalog
from ladle.serve.backends import Backend
from ladle.serve.jobs import (
    Tooling,
    check_prompt_chars,
    check_prompt_tokens,
    constraint_of,
    make_job,
    raw_text,
    tools_of,
)
from ladle.serve.metrics import Metrics
from ladle.serve.replies import Reply, sse, stream_error, usage
from ladle.serve.rows import Job
from ladle.serve.schema import ApiError, ChatRequest, ClientGone, CompletionRequest, Sampling, TokenizeRequest
from ladle.serve.settings import Settings


class Generation:
    """``POST /v1/completions`` and ``/v1/chat/completions`` over one backend."""

    def __init__(self, backend: Backend, settings: Settings, metrics: Metrics, catalog: Catalog, capture=None):
        self.backend, self.settings, self.metrics, self.catalog = backend, settings, metrics, catalog
        self.capture = capture  # a ``ladle.serve.capture.Recorder`` with serve.capture on, else None
        self.limits = settings.limits
        self.prompt_chars = self.limits.prompt_chars(backend.context_length)

    def add_to(self, app: FastAPI) -> None:
        app.post("/v1/completions")(self.completions)
        app.post("/v1/chat/completions")(self.chat)
        app.post("/tokenize")(self.tokenize)

    async def tokenize(self, req: TokenizeRequest) -> dict:
        """vLLM's ``/tokenize``: the token ids a request's prompt or messages become here (the chat template with
        its generation prompt unless ``add_generation_prompt`` is false), which is how the parity gate checks that
        the server renders conversations as training did."""
        self.adapter_of(req.model)  # a model that is not served is a 404, as for generation
        if req.prompt is not None:
            check_prompt_chars(len(req.prompt), self.prompt_chars, "prompt")
            ids = await asyncio.to_thread(self.backend.encode, req.prompt)
        else:
            check_prompt_chars(sum(len(m.content or "") for m in req.messages), self.prompt_chars, "messages")
            messages = tools_api.template_messages(req.messages)
            listed = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
            try:
                ids = await asyncio.to_thread(self.render, messages, listed, req.add_generation_prompt)
            except TemplateError as exc:
                raise ApiError(
                    400, f"The model's chat template refused these messages: {exc}.", param="messages"
                ) from None
        return {"count": len(ids), "max_model_len": self.backend.context_length, "tokens": ids}

    def render(self, messages: list[dict], tools: list[dict] | None, generation_prompt: bool) -> list[int]:
        if generation_prompt:
            return self.backend.encode_chat(messages, tools)
        tokenizer = self.backend.tokenizer
        return self.backend.encode(tokenizer.apply_chat_template(messages, tools=tools, tokenize=False))

    async def completions(self, req: CompletionRequest, request: Request):
        """OpenAI's text completion (``prompt``), streamed as server-sent events with ``stream: true``."""
        self.refuse_when_full()  # before any work on the request: tokenizing, decoding, compiling its grammar
        if isinstance(req.prompt, list):  # token ids: bounded by the context, then by the vocabulary
            check_prompt_tokens(len(req.prompt), self.backend.context_length)
            vocab = self.backend.vocab_size
            bad = next((i for i in req.prompt if i >= vocab), None) if vocab else None
            if bad is not None:
                raise ApiError(
                    400,
                    f"prompt: token id {bad} is outside this model's vocabulary (0..{vocab - 1}).",
                    param="prompt",
                )
            ids, req.prompt = req.prompt, await asyncio.to_thread(self.backend.decode, req.prompt)
        else:
            check_prompt_chars(len(req.prompt), self.prompt_chars, "prompt")
            ids = await asyncio.to_thread(self.backend.encode, req.prompt)
        return await self.serve(request, req, ids, "text_completion", "cmpl")

    async def chat(self, req: ChatRequest, request: Request):
        """OpenAI's chat completion (``messages``, through the model's chat template), streamed as server-sent
        events with ``stream: true``."""
        if len(req.messages) > self.limits.max_messages:
            raise ApiError(
                400,
                f"messages has {len(req.messages)} items; this server takes at most {self.limits.max_messages} "
                "(serve.limits.max_messages).",
                param="messages",
                code="too_many_messages",
            )
        check_prompt_chars(sum(len(m.content or "") for m in req.messages), self.prompt_chars, "messages")
        self.refuse_when_full()  # before any work on the request: its template, tokens and grammar
        # OpenAI's `developer` is the newer name of `system`, which chat templates know.
        messages = tools_api.template_messages(req.messages)
        tooling = tools_of(req, self.backend)
        listed = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        try:
            ids = await asyncio.to_thread(self.backend.encode_chat, messages, listed)
        except TemplateError as exc:  # the template refuses these turns (an order or role it does not take)
            raise ApiError(
                400,
                f"The model's chat template refused these messages: {exc}. Send turns it takes (e.g. user and "
                "assistant alternating, one system message first).",
                param="messages",
                code="invalid_messages",
            ) from None
        return await self.serve(request, req, ids, "chat.completion", "chatcmpl", tooling)

    def refuse_when_full(self) -> None:
        """429 with Retry-After while ``serve.limits.max_queue`` requests wait: checked before a request costs
        the server anything (a grammar's compilation is milliseconds to seconds of CPU)."""
        if self.backend.queue_depth() >= self.limits.max_queue:
            raise ApiError(
                429,
                f"{self.backend.queue_depth()} requests are waiting for this server (serve.limits.max_queue = "
                f"{self.limits.max_queue}); retry after a second.",
                code="queue_full",
                kind="rate_limit_error",
                headers={"Retry-After": "1"},
            )

    async def serve(
        self, request: Request, req: Sampling, ids: list[int], kind: str, prefix: str, tooling: Tooling | None = None
    ):
        self.refuse_when_full()  # again: the queue may have filled while this request was tokenized
        adapter = self.adapter_of(req.model, request.headers.get(PINNED_HEADER))
        job = make_job(req, ids, self.backend, self.settings)
        job.adapter = adapter
        job.captured = request.headers.get(capture_api.INTERNAL_HEADER) != "1"
        job.constraint = await asyncio.to_thread(constraint_of, req, self.backend, tooling)
        started, route = time.monotonic(), request.url.path
        job.deadline = job.submitted + self.limits.queue_timeout_s
        events: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        job.emit = lambda event, data: loop.call_soon_threadsafe(events.put_nowait, (event, data))
        job.deliver = events.put_nowait
        self.backend.submit(job)
        reply = Reply(f"{prefix}-{uuid.uuid4().hex}", kind, req.model or self.settings.model, int(time.time()))
        watcher = asyncio.create_task(self.watch_disconnect(request, job, events))
        try:
            first = await self.next_event(events)
            if first[0] == "text":  # the answer's first text: its time to first token
                self.metrics.ttft.observe(time.monotonic() - job.submitted)
            if req.stream:
                include_usage = bool(req.stream_options and req.stream_options.include_usage)
                watcher.cancel()  # from here the streaming response hears the hang-up
                echo = req.prompt if job.echo else None
                answered = lambda text, calls, done: self.finished(req, reply, job, text, calls, done, started, route)  # noqa: E731
                chunks = (
                    self.stream_calls(first, events, job, reply, include_usage, tooling, answered)
                    if tooling is not None and tooling.parses
                    else self.stream(first, events, job, reply, include_usage, echo, answered)
                )
                return StreamingResponse(chunks, media_type="text/event-stream")
            text, done, logprobs = await self.collect(first, events, job)
        finally:
            watcher.cancel()
        if tooling is not None and tooling.parses:
            content, calls = tooling.format.parse(raw_text(self.backend, job, text))
            if calls:
                done = {**done, "finish_reason": "tool_calls"}
                self.finished(req, reply, job, content, calls, done, started, route)
                return reply.whole(content, done, logprobs, calls)
        self.finished(req, reply, job, text, None, done, started, route)
        if job.echo:  # the prompt as sent, then the answer; the prompt's tokens first in the log-probabilities
            text = req.prompt + text
            logprobs = None if logprobs is None else [*(job.prompt_logprobs or []), *logprobs]
        return reply.whole(text, done, logprobs)

    def adapter_of(self, model: str | None, pinned: str | None = None) -> str | None:
        """The engine's key of the adapter ``model`` names (None: the base). ``pinned``: the version a front's
        adapter canary chose for a bare adapter name (``PINNED_HEADER``); the answer still names the model as asked.

        Raises:
            ApiError: 404 in OpenAI's shape, naming what is served.
        """
        if pinned and model and "@" not in model and model != self.settings.model:
            # A version the registry no longer aliases was unloaded by a sync that came before the front heard the
            # verdict: the canary is over, and the name's own version answers (never a failed request).
            with contextlib.suppress(KeyError):
                return self.catalog.resolve(f"{model}@{pinned}")
        try:
            return self.catalog.resolve(model)
        except KeyError:
            served = f"'{self.settings.model}'"
            if self.catalog:
                served += " and its adapters (GET /v1/models lists them)"
            raise ApiError(
                404,
                f"The model '{model}' does not exist; this server serves {served}.",
                param="model",
                code="model_not_found",
                kind="not_found_error",
            ) from None

    async def watch_disconnect(self, request: Request, job: Job, events: asyncio.Queue) -> None:
        """Cancel ``job`` when its client hangs up before the answer is sent (uvicorn keeps the handler running,
        so without this an abandoned request would generate to its end)."""
        while (await request.receive())["type"] != "http.disconnect":
            pass
        self.backend.cancel(job)
        self.metrics.cancelled.inc()
        events.put_nowait(("gone", {}))

    def finished(
        self, req: Sampling, reply: Reply, job: Job, text: str, calls, done: dict, started: float, route: str
    ) -> None:
        """An answer given whole (``text`` and ``calls``, ended as ``done`` says): counted in the metrics, and
        handed to the capture (``serve.capture``) with the request as sent (its messages or prompt and its
        sampling), the tokens, the latency and the model version that answered."""
        self.metrics.count(route, 200)
        self.metrics.prompt_tokens.inc(done["prompt_tokens"])
        self.metrics.completion_tokens.inc(done["completion_tokens"])
        self.metrics.latency.observe(time.monotonic() - started)
        if self.capture is None or not job.captured:
            return
        model, version = self.settings.model, self.settings.version
        if job.adapter is not None:  # an adapter's rows: its own name and version label
            model, version = self.catalog.named(job.adapter) or (req.model or model, None)
        answer = {"content": text}
        if calls:
            answer["tool_calls"] = tools_api.openai_calls(calls)
        record = {
            "at": capture_api.now_iso(),
            "route": "chat" if reply.chat else "completions",
            "asked_model": req.model,
            "request": req.model_dump(mode="json", exclude_none=True, exclude={"stream", "stream_options", "model"}),
            "answer": answer,
            "finish_reason": done["finish_reason"],
            "prompt_tokens": done["prompt_tokens"],
            "completion_tokens": done["completion_tokens"],
            "latency_s": round(time.monotonic() - started, 4),
        }
        self.capture.record(reply.id, record, model, version)

    async def next_event(self, events: asyncio.Queue) -> tuple[str, dict]:
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

    async def collect(self, first: tuple[str, dict], events: asyncio.Queue, job: Job) -> tuple[str, dict, list | None]:
        pieces, logprobs, (event, data) = [], [], first
        try:
            while event == "text":
                pieces.append(data["text"])
                logprobs += data.get("logprobs", [])
                event, data = await self.next_event(events)
            logprobs += data.get("logprobs", [])
            return "".join(pieces), data, logprobs if job.logprobs is not None else None
        except asyncio.CancelledError:  # the server is going away under this request: stop generating for it
            self.backend.cancel(job)
            self.metrics.cancelled.inc()
            raise

    async def stream_calls(
        self, first, events, job: Job, reply: Reply, include_usage: bool, tooling: Tooling, answered
    ):
        """A streamed answer that may be tool calls, as OpenAI streams one: the role, the content as it is
        written (``tools_api.ContentStream``: up to where a call may begin), then, once the answer is whole and
        parsed, the rest of the content, each call with its id, name and arguments, and the finish reason. Each
        token's log-probabilities ride with the content that holds it (those of held text with the last chunk)."""
        ended, (event, data) = False, first
        wanted = job.logprobs is not None
        split = tools_api.ContentStream(tooling.format, tools_api.tag_ids(tooling.format, self.backend_tokenizer()))
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
                    event, data = await self.next_event(events)
            except ApiError as exc:
                ended = True
                yield stream_error(exc)
                yield "data: [DONE]\n\n"
                return
            ended, done = True, data
            held += done.get("logprobs", []) if wanted else []
            content, calls = tooling.format.parse(raw_text(self.backend, job, split.text))
            rest = split.rest(content if calls else split.text)
            if rest or held:
                yield sse(reply.chunk({"content": rest}, None, held if wanted else None))
            for index, call in enumerate(tools_api.openai_calls(calls)):
                yield sse(reply.chunk({"tool_calls": [{"index": index, **call}]}))
            yield sse(reply.chunk({}, "tool_calls" if calls else done["finish_reason"]))
            if include_usage:
                yield sse({**reply.head(), "choices": [], "usage": usage(done)})
            answered(
                content if calls else split.text,
                calls or None,
                {**done, "finish_reason": "tool_calls"} if calls else done,
            )
            yield "data: [DONE]\n\n"
        finally:
            if not ended:  # the client went away while the answer was streamed
                self.backend.cancel(job)
                self.metrics.cancelled.inc()

    def backend_tokenizer(self):
        return getattr(self.backend, "tokenizer", None)

    async def stream(self, first, events, job: Job, reply: Reply, include_usage: bool, echo: str | None, answered):
        ended, (event, data), offset = False, first, 0
        wanted = job.logprobs is not None
        pieces: list[str] = []  # the answer's text, for the capture
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
                    pieces.append(data["text"])
                    yield sse(
                        reply.chunk({"content": data["text"]} if reply.chat else data["text"], None, logprobs, offset)
                    )
                    offset += sum(len(e["token"]) for e in logprobs or [])
                else:
                    ended = True
                    yield sse(reply.chunk({} if reply.chat else "", data["finish_reason"], logprobs, offset))
                    if include_usage:
                        yield sse({**reply.head(), "choices": [], "usage": usage(data)})
                    answered("".join(pieces), None, data)
                    break
                try:
                    event, data = await self.next_event(events)
                except ApiError as exc:  # the status line is sent: the error goes in the stream
                    ended = True
                    yield stream_error(exc)
                    break
            yield "data: [DONE]\n\n"
        finally:
            if not ended:  # the client went away mid-stream
                self.backend.cancel(job)
                self.metrics.cancelled.inc()
