"""What one request may ask of the inference server (``serve.limits``).

Every bound is checked before the work it bounds: the body size before the body is parsed, messages, prompt
characters and stop strings before tokenization, ``max_tokens`` before the request is queued, the queue's length
before it joins and its wait while it waits. A request over a bound gets a 4xx naming the field (and a full queue
a 429 with ``Retry-After``), so one client cannot stall liveness, hold the engine for tens of thousands of steps
or queue without end in front of everyone else.
"""

from __future__ import annotations

from pydantic import Field

from ladle.section import Section

CHARS_PER_TOKEN = 32
"""``max_prompt_chars`` 0 allows this many characters per token of the model's context: far more than any
tokenizer packs into one token of real text, so a prompt that fits the context is never refused by it."""


class ServeLimits(Section):
    max_body_bytes: int = Field(
        2 * 1024 * 1024,
        ge=1024,
        le=1024**3,
        description="Largest request body, in bytes; a larger one is refused with HTTP 413 before it is read whole "
        "(by the server and by ladle's front). The default holds a 128k-token prompt (about 0.5 MB of JSON) four "
        "times over; raise it for longer contexts.",
    )
    max_messages: int = Field(
        512, ge=1, le=1_000_000, description="Most messages in one chat request (HTTP 400 on `messages` above)."
    )
    max_prompt_chars: int = Field(
        0,
        ge=0,
        le=1_000_000_000,
        description="Most characters of a prompt (a chat's message contents together), checked before tokenizing. "
        f"0: {CHARS_PER_TOKEN} x the model's context length in tokens.",
    )
    max_stop_chars: int = Field(
        256, ge=1, le=65_536, description="Longest stop string, in characters (HTTP 400 on `stop` above)."
    )
    max_tokens: int = Field(
        4096,
        ge=1,
        le=1_000_000,
        description="Largest `max_tokens` (or `max_completion_tokens`) a request may ask for; above it HTTP 400 "
        "naming the field. serve.max_new_tokens, the default of a request that sends none, must not exceed it.",
    )
    max_queue: int = Field(
        256,
        ge=1,
        le=1_000_000,
        description="Requests that may wait for a place in the batch; one more is refused with HTTP 429 and "
        "`Retry-After`.",
    )
    queue_timeout_s: float = Field(
        60.0,
        gt=0,
        le=86_400,
        description="Seconds a request may wait for a place in the batch; then it is answered HTTP 503 with "
        "`Retry-After` and never generated.",
    )

    def prompt_chars(self, context_length: int) -> int:
        """The prompt character bound for a model of ``context_length`` tokens."""
        return self.max_prompt_chars or CHARS_PER_TOKEN * context_length
