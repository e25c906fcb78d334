"""One request's row in the engine: what it asked (``Job``), how its next token is chosen (``adjusted``,
``sample``), and what it sends (``RowStop``): its text detokenized incrementally, cut at its stop strings and
streamed, with each token's log-probabilities in OpenAI's shape.
"""

from __future__ import annotations

import functools
import math
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import StoppingCriteria


@dataclass
class Job:
    """One request for the engine; ``emit`` is called from the engine thread with each event."""

    ids: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None  # None: none; k: each token's log-probability and the k likeliest alternatives
    token_logprobs: list[dict] = field(default_factory=list)  # one per token in ``tokens``
    logprobs_sent: int = 0
    echo: bool = False  # with ``logprobs``: the prompt's tokens' log-probabilities too (``prompt_logprobs``)
    constraint: Any = None  # ``ladle.serve.structured.Constraint``: the grammar its tokens must follow
    prompt_logprobs: list[dict] | None = None
    emit: Callable[[str, dict], None] = lambda kind, data: None
    deliver: Callable[[tuple[str, dict]], None] | None = None  # on the server's event loop: ``emit`` without a hop
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.monotonic)
    deadline: float | None = None  # monotonic time by which it must have joined the batch (serve.limits)
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    sent: int = 0  # characters of ``text`` already emitted
    detokenizer: Any = None  # tokenizers' DecodeStream over ``tokens`` (incremental detokenization)
    fed_at: int = 0  # tokens handed to it so far ...
    read_at: int = 0  # ... and tokens whose text is in ``text`` (a character split over tokens waits)
    decoded: int = 0  # characters the detokenizer gave, before any stop string cut ``text``
    finish: str | None = None
    generator: torch.Generator | None = None
    sampled: list[float] | None = None  # a rollout's: each chosen token's log-probability at its temperature
    chosen: list[int] = field(default_factory=list)  # with ``sampled``: every token chosen, EOS included
    stop_token: int | None = None  # the EOS token that ended it (not in ``tokens``), None when none did
    writes_text: bool = True  # False: no text is made as tokens come (a rollout returns token ids; no stop strings)
    adapter: str | None = None  # the engine's key of the LoRA adapter it runs on (``ladle.serve.adapters``); None: base
    captured: bool = True  # kept by serve.capture; False for ladle's own requests (``capture.INTERNAL_HEADER``)
    # An agent's turns (``ladle.agents.episodes``): ``keep_kv`` asks for the row's keys and values when it ends
    # (``kv_out``: each layer's ``[1, heads, n, dim]`` and n, the leading tokens of ids + chosen they hold), and
    # ``resume`` hands them to the next turn, whose ids begin with those n tokens: only the rest is prefilled.
    keep_kv: bool = False
    kv_out: tuple | None = None
    resume: tuple | None = None
    key: int | None = None  # its name between a server's API and engine processes (``ladle.serve.wire``)
    ids_sent: int = 0  # tokens the engine process has told the API process of ...
    prompt_sent: bool = False  # ... and whether it sent ``prompt_logprobs``

    def __post_init__(self) -> None:
        if self.stop and not self.writes_text:
            raise ValueError("a job with stop strings must write its text (writes_text) to find them in it")

    @property
    def adjusts(self) -> bool:
        """Its logits are changed before choosing (penalties or a logit bias)."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0 or self.logit_bias
        )

    @property
    def tokens_needed(self) -> int:
        """KV cache columns this request needs alone: its prompt and every token it may generate."""
        return len(self.ids) + self.max_new_tokens

    def generator_on(self, device: torch.device) -> torch.Generator:
        """The request's own random generator, on the device its logits are on (a CUDA draw refuses a CPU
        generator). Seeded by the request's ``seed``, or once from the OS when it has none, so a job's
        draws never depend on the process-wide RNG or on its neighbours."""
        if self.generator is None or self.generator.device != device:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(self.seed if self.seed is not None else random.SystemRandom().getrandbits(63))
        return self.generator


def adjusted(job: Job, logits: torch.Tensor) -> torch.Tensor:
    """A row's logits (float32) as its request changes them, in this order: the repetition penalty over its prompt
    and generated tokens (Hugging Face's: a seen token's positive logit divided by it, a negative one multiplied),
    OpenAI's presence and frequency penalties over the tokens it generated (``logit - count x frequency_penalty -
    presence_penalty`` for each generated token), then its ``logit_bias`` added. Only this row is touched, so
    rows with other settings share the batch."""
    row = logits.float().clone()
    if job.repetition_penalty != 1.0:
        seen = torch.tensor(sorted({*job.ids, *job.tokens}), dtype=torch.long, device=row.device)
        picked = row[seen]
        row[seen] = torch.where(picked > 0, picked / job.repetition_penalty, picked * job.repetition_penalty)
    if (job.presence_penalty or job.frequency_penalty) and job.tokens:
        ids, counts = torch.tensor(job.tokens, dtype=torch.long, device=row.device).unique(return_counts=True)
        row[ids] -= counts.to(row.dtype) * job.frequency_penalty + job.presence_penalty
    if job.logit_bias:
        ids = torch.tensor(list(job.logit_bias), dtype=torch.long, device=row.device)
        row[ids] += torch.tensor(list(job.logit_bias.values()), dtype=row.dtype, device=row.device)
    return row


def token_entry(tokenizer, token: int, logprob: float | None) -> dict:
    """A token as OpenAI's ``logprobs`` name it: its text, its log-probability and its bytes (the token's own
    bytes, so a character split over several tokens is whole again when a client joins them)."""
    return {"token": tokenizer.decode([token]), "logprob": logprob, "bytes": token_bytes(tokenizer, token)}


@functools.cache
def byte_of() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, character to byte (transformers' ``bytes_to_unicode``, inverted): what
    every byte-level tokenizer's vocabulary is written in."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


def token_bytes(tokenizer, token: int) -> list[int]:
    """The bytes a token stands for: a byte-level BPE piece mapped back through GPT-2's byte alphabet, a
    SentencePiece byte-fallback piece (``<0xE2>``) as its byte, anything else as its decoded text in UTF-8."""
    piece = tokenizer.convert_ids_to_tokens(token)
    if isinstance(piece, str) and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        return [int(piece[3:5], 16)]
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    alphabet = byte_of()
    if isinstance(piece, str) and type(decoder).__name__ == "ByteLevel" and all(c in alphabet for c in piece):
        return [alphabet[c] for c in piece]
    return list(tokenizer.decode([token]).encode("utf-8"))


def logprob_entry(tokenizer, job: Job, logits: torch.Tensor, token: int) -> dict:
    """The chosen token's log-probability under the model's own distribution (the raw logits, before penalties,
    bias and temperature, as a forward pass gives it) and the ``job.logprobs`` likeliest alternatives."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    entry = token_entry(tokenizer, token, float(logprobs[token]))
    top = torch.topk(logprobs, job.logprobs) if job.logprobs else None
    pairs = zip(top.indices.tolist(), top.values.tolist(), strict=True) if top is not None else ()
    entry["top_logprobs"] = [token_entry(tokenizer, alt, value) for alt, value in pairs]
    return entry


def sample(job: Job, logits: torch.Tensor) -> int:
    """One token from a row's logits by its request's temperature, top-k and top-p, drawn with its own generator."""
    scaled = logits.float() / job.temperature
    if 0 < job.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, job.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if job.top_p < 1.0:
        ordered, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(ordered, dim=-1) - ordered < job.top_p
        keep[0] = True  # the top token always: a top_p below float32's least value compares as 0 < 0
        probs = torch.zeros_like(probs).scatter(0, order[keep], ordered[keep])
    return draw(probs, job.generator_on(probs.device))


def draw(probs: torch.Tensor, generator: torch.Generator, cdf: torch.Tensor | None = None) -> int:
    """One index of ``probs`` (a softmax's non-negative weights over the vocabulary) by its inverse distribution
    function: one uniform draw from ``generator``, and the first index whose running sum (float64; ``cdf`` when
    the caller made it for a batch) passes it. Exact as ``torch.multinomial`` is, which instead draws an
    exponential for every vocabulary entry: on a CPU core 59 us against 1,189 for SmolLM2's 49k vocabulary, 154
    against 3,084 at 128k (bench/RESULTS.md). A zero weight (cut by top-k or top-p) is never drawn: its running
    sum equals its predecessor's, so never first to pass the draw."""
    if cdf is None:
        cdf = torch.cumsum(probs, dim=0, dtype=torch.float64)
    total = float(cdf[-1])
    if not (total > 0 and math.isfinite(total)):  # a NaN anywhere makes the total NaN
        raise RuntimeError(f"the probabilities sum to {total}: the logits held inf or nan")
    point = torch.rand(1, generator=generator, dtype=torch.float64, device=probs.device) * total
    index = int(torch.searchsorted(cdf, point, right=True))
    if index >= probs.shape[0]:  # the draw rounded up to the total: the last token with any weight
        index = int(torch.nonzero(probs).max())
    return index


class RowStop(StoppingCriteria):
    """Ends each row on its own and streams its text; returns which rows are done."""

    def __init__(self, jobs: list[Job], tokenizer, eos: set[int]):
        self.jobs, self.tokenizer, self.eos = jobs, tokenizer, eos

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        done = []
        for row, job in enumerate(self.jobs):
            if job.finish is None:
                self.advance(job, int(input_ids[row, -1]))
            done.append(job.finish is not None)
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)

    def advance(self, job: Job, token: int, logprobs: dict | None = None) -> None:
        if job.cancelled.is_set():
            job.finish = "cancelled"
            return
        if token in self.eos:
            job.finish, job.stop_token = "stop", token
            self.end(job)
            return
        job.tokens.append(token)
        if logprobs is not None:
            job.token_logprobs.append(logprobs)
        if not job.writes_text:  # its tokens are its answer: nothing to detokenize, no stop string to find
            if len(job.tokens) >= job.max_new_tokens:
                job.finish = "length"
            return
        scanned = len(job.text)
        job.text += decode_next(self.tokenizer, job)
        cut = find_stop(job.text, job.stop, scanned)
        if cut >= 0:
            job.text, job.finish = job.text[:cut], "stop"
            flush(job, cut, final=True)
        elif len(job.tokens) >= job.max_new_tokens:
            job.finish = "length"
            self.end(job)
        else:
            flush(job, len(job.text) - held_back(job.text, job.stop))

    def end(self, job: Job) -> None:
        """Send the rest: tokens still held back as an unfinished character are decoded as they stand, as a whole
        decode of the answer would (a stop string can still appear in them)."""
        if not job.writes_text:
            return
        scanned = len(job.text)
        job.text += decode_next(self.tokenizer, job, final=True)
        cut = find_stop(job.text, job.stop, scanned)
        if cut >= 0:
            job.text, job.finish = job.text[:cut], "stop"
        flush(job, len(job.text), final=True)


def decode_next(tokenizer, job: Job, final: bool = False) -> str:
    """The text the newest tokens add, by tokenizers' own incremental detokenizer (``DecodeStream``: a step
    costs a few tokens, not the answer's length, and a token whose text depends on its neighbour reads as in a
    whole decode). A character split over tokens waits for its last byte, unless ``final``: then what is held
    back is decoded as it stands, as a whole decode of the answer would (a replacement character)."""
    from tokenizers.decoders import DecodeStream

    if job.detokenizer is None:
        job.detokenizer = DecodeStream(skip_special_tokens=True)
    backend = tokenizer.backend_tokenizer
    text = []
    for at in range(job.fed_at, len(job.tokens)):
        piece = job.detokenizer.step(backend, job.tokens[at])
        if piece is not None:
            text.append(piece)
            job.read_at = at + 1
    job.fed_at = len(job.tokens)
    if final and job.read_at < len(job.tokens):  # held back: the rest of a whole decode, as it stands
        whole = tokenizer.decode(job.tokens, skip_special_tokens=True)
        text.append(whole[job.decoded + sum(map(len, text)) :])
        job.read_at = len(job.tokens)
    out = "".join(text)
    job.decoded += len(out)
    return out


def find_stop(text: str, stops: list[str], scanned: int) -> int:
    """Where the first stop string starts in ``text``, or -1. Only the part that can hold a new match is
    searched (from ``scanned``, the length already searched, less each stop's length), so a step costs the new
    text and the stops, not the whole answer."""
    found = [text.find(s, max(0, scanned - len(s) + 1)) for s in stops]
    return min((i for i in found if i >= 0), default=-1)


def held_back(text: str, stops: list[str]) -> int:
    """Characters at the end of ``text`` that may be the start of a stop string (not streamed yet)."""
    return max((n for s in stops for n in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:n])), default=0)


def flush(job: Job, upto: int, final: bool = False) -> None:
    """Emit ``job.text[job.sent:upto]``. Until ``final``, text past a held-back stop prefix waits for the next
    token, and so does a trailing replacement character (a multi-byte character half decoded). With the text go
    the log-probabilities of the tokens decoded into it so far (``unsent_logprobs``)."""
    while not final and upto > job.sent and job.text[upto - 1] == "\ufffd":
        upto -= 1
    if upto > job.sent:
        data = {"text": job.text[job.sent : upto]}
        if job.logprobs is not None:
            data["logprobs"] = unsent_logprobs(job, job.read_at)
        job.emit("text", data)
        job.sent = upto


def unsent_logprobs(job: Job, upto: int) -> list[dict]:
    """The log-probability entries of tokens ``[job.logprobs_sent, upto)``, marked sent."""
    upto = min(upto, len(job.token_logprobs))
    entries = job.token_logprobs[job.logprobs_sent : upto]
    job.logprobs_sent = max(job.logprobs_sent, upto)
    return entries


def finish(job: Job) -> None:
    """Tell the request it ended (a cancelled one has nobody left to tell)."""
    if job.finish != "cancelled":
        done = {"finish_reason": job.finish, "prompt_tokens": len(job.ids), "completion_tokens": len(job.tokens)}
        if job.logprobs is not None:
            done["logprobs"] = unsent_logprobs(job, len(job.tokens))  # those of tokens still held back
        job.emit("done", done)
