"""Batched generation for the transformers backend: concurrent requests share forward passes.

Requests wait in a queue while a batch runs; the engine thread then takes up to ``max_batch`` of them and
runs them through one ``generate`` call, left-padded with an attention mask. Every request keeps its own
sampling: a logits processor chooses each row's token itself (greedy argmax, or temperature / top-p sampling
from the request's own generator, seeded when the request has a seed) and masks the others, so ``generate``
runs greedy over the batch and a request's tokens do not depend on what it was batched with. A stopping
criterion ends each row on its own (its ``max_tokens``, EOS, a stop string, or its client gone) and streams
each new piece of text to its request.

Why not transformers' continuous batching (``init_continuous_batching``): its manager samples with one
generation config and one RNG for all requests, so a greedy request beside a sampled one, per-request
``top_p`` and per-request ``seed`` cannot all be honoured, and the OpenAI API promises all three. Requests
that arrive during a batch wait for the next one (at most one batch's time); the bench measures the result.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import LogitsProcessor, StoppingCriteria


@dataclass
class Job:
    """One request for the engine; ``emit`` is called from the engine thread with each event."""

    ids: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    emit: Callable[[str, dict], None] = lambda kind, data: None
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.monotonic)
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    sent: int = 0  # characters of ``text`` already emitted
    finish: str | None = None
    generator: torch.Generator | None = None

    def __post_init__(self):
        if self.temperature > 0:
            self.generator = torch.Generator()
            self.generator.manual_seed(self.seed if self.seed is not None else torch.seed())


class RowSampler(LogitsProcessor):
    """Chooses each row's next token by its own request's settings, then leaves only that token."""

    def __init__(self, jobs: list[Job]):
        self.jobs = jobs

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        for row, job in enumerate(self.jobs):
            if job.finish is not None or job.temperature <= 0:
                continue  # greedy: generate's own argmax over the untouched scores
            probs = torch.softmax(scores[row].float() / job.temperature, dim=-1)
            if job.top_p < 1.0:
                ordered, order = torch.sort(probs, descending=True)
                keep = torch.cumsum(ordered, dim=-1) - ordered < job.top_p  # always keeps the top token
                probs = torch.zeros_like(probs).scatter(0, order[keep], ordered[keep])
            token = int(torch.multinomial(probs, 1, generator=job.generator))
            scores[row] = float("-inf")
            scores[row, token] = 0.0
        return scores


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

    def advance(self, job: Job, token: int) -> None:
        if job.cancelled.is_set():
            job.finish = "cancelled"
            return
        if token in self.eos:
            job.finish = "stop"
            flush(job, len(job.text), final=True)
            return
        job.tokens.append(token)
        job.text = self.tokenizer.decode(job.tokens, skip_special_tokens=True)
        cut = min((i for i in (job.text.find(s) for s in job.stop) if i >= 0), default=-1)
        if cut >= 0:
            job.text, job.finish = job.text[:cut], "stop"
            flush(job, cut, final=True)
        elif len(job.tokens) >= job.max_new_tokens:
            job.finish = "length"
            flush(job, len(job.text), final=True)
        else:
            flush(job, len(job.text) - held_back(job.text, job.stop))


def held_back(text: str, stops: list[str]) -> int:
    """Characters at the end of ``text`` that may be the start of a stop string (not streamed yet)."""
    return max((n for s in stops for n in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:n])), default=0)


def flush(job: Job, upto: int, final: bool = False) -> None:
    """Emit ``job.text[job.sent:upto]``. Until ``final``, text past a held-back stop prefix waits for the next
    token, and so does a trailing replacement character (a multi-byte character half decoded)."""
    if not final:
        upto = min(upto, len(job.text[:upto].rstrip("\ufffd")))
    if upto > job.sent:
        job.emit("text", {"text": job.text[job.sent : upto]})
        job.sent = upto


class Engine:
    """The thread that runs batches; ``submit`` is safe from any thread."""

    def __init__(self, model, tokenizer, device: str, max_batch: int, on_batch: Callable[[int], None] | None = None):
        self.model, self.tokenizer, self.device, self.max_batch = model, tokenizer, device, max_batch
        self.on_batch = on_batch or (lambda size: None)
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        eos = model.generation_config.eos_token_id or tokenizer.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [eos])
        self.jobs: queue.Queue[Job] = queue.Queue()
        self.thread = threading.Thread(target=self.loop, name="ladle-engine", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> None:
        self.jobs.put(job)

    def alive(self) -> bool:
        return self.thread.is_alive()

    def loop(self) -> None:
        while True:
            batch = [self.jobs.get()]
            while len(batch) < self.max_batch:
                try:
                    batch.append(self.jobs.get_nowait())
                except queue.Empty:
                    break
            batch = [job for job in batch if not job.cancelled.is_set()]
            if not batch:
                continue
            self.on_batch(len(batch))
            try:
                self.run(batch)
            except Exception as exc:  # a failed batch fails its requests, never the engine
                for job in batch:
                    if job.finish is None:
                        job.emit("error", {"message": f"{type(exc).__name__}: {exc}"})

    def run(self, batch: list[Job]) -> None:
        width = max(len(job.ids) for job in batch)
        ids = torch.full((len(batch), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, job in enumerate(batch):
            ids[row, width - len(job.ids) :] = torch.tensor(job.ids)
            mask[row, width - len(job.ids) :] = 1
        with torch.no_grad():
            self.model.generate(
                ids.to(self.device),
                attention_mask=mask.to(self.device),
                max_new_tokens=max(job.max_new_tokens for job in batch),
                do_sample=False,
                logits_processor=[RowSampler(batch)],
                stopping_criteria=[RowStop(batch, self.tokenizer, self.eos)],
                pad_token_id=self.pad,
            )
        for job in batch:
            if job.finish is None:  # generate's own end (its length limit) without our criterion's say
                job.finish = "length"
                flush(job, len(job.text), final=True)
            if job.finish != "cancelled":
                job.emit(
                    "done",
                    {"finish_reason": job.finish, "prompt_tokens": len(job.ids), "completion_tokens": len(job.tokens)},
                )
