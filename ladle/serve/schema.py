"""The OpenAI request bodies a model server takes, and the errors it answers with.

Bodies follow the OpenAI API; unknown fields are refused by name, never silently dropped, and every error is
OpenAI's envelope ``{"error": {"message", "type", "param", "code"}}`` with a 4xx status for anything the client
sent.
"""

from __future__ import annotations

import math
from typing import Literal

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ladle.serve import tools as tools_api
from ladle.serve.guard import envelope

UNSUPPORTED = (
    "functions",
    "function_call",
    "best_of",
    "echo",  # chat has none; completions take it
    "suffix",
)


MIN_TEMPERATURE = 1e-4
"""Below this a request is answered greedily: its distribution is the argmax to float precision, and dividing
logits by a temperature near zero overflows to inf (a sampling error, not an answer)."""


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


class AdapterRequest(BaseModel):
    """``POST /v1/adapters``: one version of a LoRA adapter to serve beside the base."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(description="What the OpenAI `model` field says to use it.")
    path: str = Field(description="The adapter folder (peft's save_pretrained): a local path or a store URL.")
    version: str = Field("1", description="Its version label (`name@VERSION` addresses it).")
    aliases: list[str] = Field(default_factory=list, description="Other labels (`champion`, `challenger`).")
    default: bool = Field(True, description="`name` alone addresses this version from now on.")


class BindRequest(BaseModel):
    """``POST /v1/adapters/bind``: serve a registered model's champion and challenger as adapter ``name``."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(description="What the OpenAI `model` field says to use it.")
    registered_model: str = Field(description="The registered model (its versions are LoRA adapters of this base).")


class FeedbackSource(BaseModel):
    """Who judged (MLflow's ``AssessmentSource``)."""

    model_config = ConfigDict(extra="forbid")
    source_type: Literal["HUMAN", "LLM_JUDGE", "CODE"] = Field("HUMAN", description="A person, a judge model, code.")
    source_id: str | None = Field(None, max_length=256, description="Which one (a user id, a judge's name).")


class FeedbackRequest(BaseModel):
    """``POST /v1/feedback``: what a user (or a judge) said about one answer, shaped as MLflow's assessments."""

    model_config = ConfigDict(extra="forbid")
    response_id: str = Field(min_length=1, max_length=200, description="The answer's `id`, as the server returned it.")
    name: str = Field("user_feedback", min_length=1, max_length=100, description="What is judged (MLflow's name).")
    value: bool | float = Field(description="true (thumbs up) or false (thumbs down), or a score.")
    rationale: str | None = Field(None, description="The user's comment.")
    correction: str | None = Field(None, description="The answer it should have given (MLflow's expectation).")
    source: FeedbackSource = Field(default_factory=FeedbackSource)

    @field_validator("value")
    @classmethod
    def _finite(cls, value: bool | float) -> bool | float:
        if not isinstance(value, bool) and not math.isfinite(value):
            raise ValueError("a score must be a finite number (or true / false)")
        return value


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


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (vLLM's): a prompt, or chat messages through the model's template, as token ids."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    tools: list[tools_api.Tool] | None = Field(None, max_length=128)
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send either prompt or messages")
        return self


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
