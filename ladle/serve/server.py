"""OpenAI-compatible HTTP API over a serving backend (FastAPI + uvicorn).

Routes: ``GET /health``, ``GET /v1/models``, ``POST /v1/completions``,
``POST /v1/chat/completions``. ``temperature: 0`` (the default) is greedy.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from fastapi import FastAPI, HTTPException
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, ConfigDict, Field

from ladle.serve.backends import Backend, Generation


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI clients send fields we do not use
    model: str | None = None
    max_tokens: int = Field(32, ge=1, le=8192)
    temperature: float = Field(0.0, ge=0.0, le=2.0)


class CompletionRequest(Sampling):
    prompt: str


class ChatRequest(Sampling):
    messages: list[ChatMessage] = Field(min_length=1)


def usage(gen: Generation) -> dict:
    return {
        "prompt_tokens": gen.prompt_tokens,
        "completion_tokens": gen.completion_tokens,
        "total_tokens": gen.prompt_tokens + gen.completion_tokens,
    }


def create_app(backend: Backend, model_name: str) -> FastAPI:
    """The API app serving ``backend`` under the model id ``model_name``."""
    app = FastAPI(title="ladle inference server")

    def check_model(requested: str | None) -> None:
        if requested not in (None, model_name):
            raise HTTPException(404, f"model {requested!r} is not served here; this server serves {model_name!r}")

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok", "model": model_name, "backend": backend.name}

    @app.get("/v1/models")
    def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "ladle"}]}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest) -> dict:
        check_model(req.model)
        gen = await run_in_threadpool(backend.complete, req.prompt, req.max_tokens, req.temperature)
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": model_name,
            "usage": usage(gen),
            "choices": [{"index": 0, "text": gen.text, "finish_reason": gen.finish_reason}],
        }

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest) -> dict:
        check_model(req.model)
        messages = [m.model_dump() for m in req.messages]
        gen = await run_in_threadpool(backend.chat, messages, req.max_tokens, req.temperature)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model_name,
            "usage": usage(gen),
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": gen.text}, "finish_reason": gen.finish_reason}
            ],
        }

    return app
