"""The whole contract between a model server's API process and its engine process: the messages they exchange.

The API process (``ladle.serve.client``) parses, validates, tokenizes and streams; the engine process
(``ladle.serve.engine_side``) schedules, runs the forwards, detokenizes each row and applies its stop strings.
They talk over one duplex ``multiprocessing`` pipe (a Unix socket pair, messages pickled), each side with a
thread of its own that only moves messages, so neither the event loop nor the decode loop ever waits on the
other's socket:

    API -> engine   Submit (one request), Cancel (its client went away), Adapter (register or forget one)
    engine -> API   Loaded (the model is up) or LoadFailed, then Report (events, queue depth, health) per step

Why a pipe, not ZeroMQ or shared memory: the traffic is one small message per request and one per decode step
(every row's new text together), a few hundred a second at most on a CPU and a few thousand on a GPU; a pipe
moves one in tens of microseconds (``bench/serve_split.py``), needs no library and no port, and its end of file
is how each side learns that the other is gone. Shared memory would pay where tensors cross, and none does:
tokens and text do.

Detokenization and stop strings stay with the engine (unlike vLLM V1, where the API process detokenizes): a row
whose stop string appears ends at that step, its KV cache freed at once, and the text it sends is already cut.
That costs the engine a ``DecodeStream`` step per token (``bench/detokenize.py``: microseconds), and keeps the
API process's work per step to forwarding what it receives, which is what keeps ``/health`` fast.
"""

from __future__ import annotations

from dataclasses import dataclass, field

REQUEST_FIELDS = (
    "ids",
    "max_new_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "logprobs",
    "echo",
    "submitted",
    "deadline",
    "adapter",
)
"""The fields of ``ladle.serve.rows.Job`` that a request sets; the rest are the engine's own bookkeeping."""


@dataclass(slots=True)
class Submit:
    """One request for the engine: ``key`` names it in both processes, ``seq`` counts submits (the queue depth's
    share still in the pipe is ``seq`` less the engine's last ``Report.received``)."""

    key: int
    seq: int
    request: dict
    grammar: str | None = None  # llguidance's grammar (already validated by the API process); None: free text

    @classmethod
    def of(cls, job, key: int, seq: int, grammar: str | None) -> Submit:
        return cls(key, seq, {name: getattr(job, name) for name in REQUEST_FIELDS}, grammar)


@dataclass(slots=True)
class Cancel:
    """The request's client went away: drop it (no further event is sent for it)."""

    key: int


@dataclass(slots=True)
class Adapter:
    """Register the LoRA adapter at ``path`` under ``key`` (loaded when a request first needs it), or, with
    ``path`` None, forget ``key`` (unloaded once no running row uses it)."""

    key: str
    path: str | None = None
    size: int = 0


@dataclass(slots=True)
class Loaded:
    """The engine process loaded the model and runs its loop."""

    pid: int
    device: str


@dataclass(slots=True)
class LoadFailed:
    """The engine process could not load the model (the message names the reason); it exits next."""

    message: str


@dataclass(slots=True)
class Report:
    """What happened since the last report: each request's events in order (``(key, kind, data)``: ``text``,
    then ``done`` or ``error``, as ``Job.emit`` sends them; ``done`` adds the answer's ``tokens`` and, for an
    echo with log-probabilities, ``prompt_logprobs``), the engine's queue depth, the last ``Submit.seq`` it took,
    whether its steps succeed, and the batch size of each step."""

    events: list[tuple[int, str, dict]] = field(default_factory=list)
    depth: int = 0
    received: int = 0
    healthy: bool = True
    batches: list[int] = field(default_factory=list)
