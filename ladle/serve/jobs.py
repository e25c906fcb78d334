"""A validated request made into the engine's job: every bound of ``serve.limits`` and of the backend checked
before any work, its tools and its grammar resolved.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ladle.serve import tools as tools_api
from ladle.serve.backends import Backend
from ladle.serve.rows import Job
from ladle.serve.schema import ADJUSTMENTS, ECHO_LOGITS_BYTES, MIN_TEMPERATURE, ApiError, ChatRequest, Sampling
from ladle.serve.settings import Settings


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
        ApiError: ``n`` > 1, or a prompt and completion longer than the context.
    """
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
    bounds = [(backend.context_length, f"This model's maximum context length is {backend.context_length} tokens")]
    if backend.kv_tokens is not None:
        bounds.append(
            (
                backend.kv_tokens,
                f"This server's KV cache holds {backend.kv_tokens} tokens across its batch (serve.kv_cache_tokens)",
            )
        )
    for bound, what in bounds:
        if len(ids) + limit > bound:
            raise ApiError(
                400,
                f"{what}; the prompt has {len(ids)} and max_tokens is {limit}. Shorten the prompt or lower max_tokens.",
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
