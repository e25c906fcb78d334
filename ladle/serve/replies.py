"""The OpenAI response objects of one request: whole, or as server-sent event chunks."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ladle.serve import tools as tools_api
from ladle.serve.guard import envelope
from ladle.serve.schema import ApiError


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
