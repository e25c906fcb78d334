"""Continuous batching for the transformers backend: concurrent requests share every decode step.

The engine thread keeps the running requests in one batch with a shared KV cache. A request that arrives
is prefilled on its own and joins at the next decode step; one that ends (its ``max_tokens``, EOS, a stop
string, or its client gone) leaves at once, so nobody waits for another request's answer to finish. Each
row keeps its own sampling: ``sample`` chooses every row's token by that request's settings (greedy
argmax, or temperature / top-p from the request's own generator, seeded when it has a seed), and
``RowStop`` ends and streams each row on its own. Rows are left-padded; attention treats the padding as
absent and position ids are per row, so a request's greedy answer does not depend on its neighbours.

The KV cache is transformers' ``DynamicCache``, built and rebuilt only through its own constructor,
``update`` and ``batch_select_indices``: rows that join or leave give a new cache of the joined tensors, so
every layer's own bookkeeping (its length, for a sliding window its position) stays the library's. Every
layer keeps its full width, sliding-window ones included: the window is applied by the attention mask, which
transformers builds from the cache's lengths, so a row that joins a running batch sees exactly the window it
would alone. That gives up a sliding layer's memory saving for correctness under joins; the planner's KV
term already counts every layer at full width. Layers that are not key/value attention (linear attention,
state-space) cannot be joined this way and are refused when the backend starts.

Memory is bounded by a KV budget in tokens (``kv_tokens``: rows x padded width, from the plan's
``serve.kv_cache_tokens``). A request is admitted, in arrival order, only when the batch with it can run to
every row's ``max_tokens`` within the budget; one that can never fit is refused by the server with a 400
before it reaches the engine, so no request fails its neighbours by running the cache out of memory.

Why not transformers' own continuous batching (``init_continuous_batching``): its manager samples with one
generation config and one RNG for all requests, so a greedy request beside a sampled one, per-request
``top_p`` and per-request ``seed`` cannot all be honoured, and the OpenAI API promises all three.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable

import torch

from ladle.data.tokenize import stop_ids
from ladle.errors import LadleError
from ladle.serve.rows import Job, RowStop, adjusted, draw, finish, logprob_entry, sample, token_entry

KV_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})
"""Decoder layer types whose cache is keys and values the engine can join and split."""

FAILING_STEPS = 3
"""Steps (prefills or decodes) failing in a row after which the engine reports itself unhealthy. One failure can
be one request's (its prompt); three in a row with nothing succeeding between them is the device or the model."""


class Engine:
    """Continuous batching on the engine's own thread; ``submit`` is safe from any thread.

    Every decode step runs all active requests together with one ``forward`` over a shared KV cache
    (left-padded rows, explicit position ids). A request that arrives is prefilled on its own and joins
    the running batch at the next step; a finished or cancelled one leaves at once. So no request waits
    for another's answer to end, and each row samples and stops by its own settings (``sample``,
    ``RowStop``). Attention treats a row's padding as absent, so a request's greedy answer is the one it
    gets alone (tested).
    """

    def __init__(
        self,
        model,
        tokenizer,
        device: str,
        max_batch: int,
        on_batch: Callable[[int], None] | None = None,
        kv_tokens: int | None = None,
        thread: bool = True,
        adapters=None,
    ):
        check_cache_layers(model.config)
        self.adapters = adapters  # ``ladle.serve.adapters.Slots``: LoRA adapters rows may run on; None: the model only
        self.model, self.tokenizer, self.device, self.max_batch = model, tokenizer, device, max_batch
        self.kv_tokens = kv_tokens or max_batch * int(getattr(model.config, "max_position_embeddings", 0) or 2048)
        self.on_batch = on_batch or (lambda size: None)
        self.after_turn: Callable[[], None] = lambda: None  # after each turn: what it emitted can go out together
        self.waiting: deque[Job] = deque()  # taken from ``jobs``, in arrival order, not yet admitted
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.eos = stop_ids(model, tokenizer)
        self.jobs: queue.Queue[Job] = queue.Queue()
        self.failures = 0  # steps failed in a row
        self.thread = threading.Thread(target=self.loop, name="ladle-engine", daemon=True)
        if thread:  # without one, the caller drives it (``run``): a trainer's rollouts
            self.thread.start()

    def submit(self, job: Job) -> None:
        self.jobs.put(job)

    def alive(self) -> bool:
        return self.thread.is_alive()

    def healthy(self) -> bool:
        """False once ``FAILING_STEPS`` steps in a row have failed (a sticky device error fails every one): the
        server's readiness and liveness then go red, so whatever supervises it replaces the process."""
        return self.failures < FAILING_STEPS

    def depth(self) -> int:
        """Requests waiting for a place in the batch."""
        return len(self.waiting) + self.jobs.qsize()

    def loop(self) -> None:
        batch = Batch(self)
        while True:
            if not batch.jobs and not self.waiting:
                self.waiting.append(self.jobs.get())  # idle: wait for work
            try:
                batch = self.turn(batch)
            finally:
                self.after_turn()

    def run(self, jobs: list[Job]) -> None:
        """Serve ``jobs`` to their ends on the calling thread (an engine made with ``thread=False``): all of them
        waiting from the first turn, so the batches formed, and so the tokens drawn, depend only on the jobs."""
        self.waiting.extend(jobs)
        batch = Batch(self)
        while self.waiting or batch.jobs:
            batch = self.turn(batch)

    def turn(self, batch: Batch) -> Batch:
        """Take what arrived, expire who waited too long, admit who fits, and run one decode step."""
        while True:
            try:
                self.waiting.append(self.jobs.get_nowait())
            except queue.Empty:
                break
        self.expire()
        arrivals = self.admissible(batch)
        if arrivals:
            self.admit(batch, arrivals)
        if not batch.jobs:
            return batch
        self.on_batch(len(batch.jobs))
        try:
            batch.step()
        except Exception as exc:  # a failed step fails its requests, never the engine
            self.count(exc)
            fail(batch.jobs, exc)
            return Batch(self)
        self.failures = 0
        return batch

    def admit(self, batch: Batch, arrivals: list[Job]) -> None:
        """Prefill the arrivals together; when that fails, each alone, so a request that cannot be prefilled
        fails by itself and neither the others arriving with it nor the running rows lose their answers."""
        try:
            batch.admit(arrivals)
        except Exception as exc:
            if len(arrivals) == 1:
                self.count(exc)
                fail(arrivals, exc)
                return
            for job in arrivals:
                if job.finish is None and not job.tokens:
                    self.admit(batch, [job])
                else:  # it had its first token when the group failed: a second prefill would send it twice
                    fail([job], exc)
            return
        self.failures = 0

    def count(self, exc: Exception) -> None:
        self.failures += 1
        if self.failures == FAILING_STEPS:
            print(f"ladle engine: {FAILING_STEPS} steps failed in a row, the last with {exc!r}; not ready", flush=True)

    def expire(self) -> None:
        """Answer the waiting requests whose ``deadline`` passed (HTTP 503): they never join the batch."""
        now = time.monotonic()
        late = [job for job in self.waiting if job.deadline is not None and now > job.deadline]
        for job in late:
            self.waiting.remove(job)
            job.finish = "error"
            if not job.cancelled.is_set():
                waited = now - job.submitted
                slots = self.adapters
                if job.adapter is not None and slots is not None and job.adapter not in slots.loaded:
                    why = (
                        f"for its adapter to be loaded: all {len(slots.loaded)} loaded adapters have requests running "
                        f"(serve.adapters.max_loaded = {slots.max_loaded})"
                    )
                else:
                    why = "for a place in the batch"
                job.emit(
                    "error",
                    {
                        "message": f"the request waited {waited:.1f} s {why} and was not "
                        "served (serve.limits.queue_timeout_s); retry later",
                        "status": 503,
                        "code": "queue_timeout",
                    },
                )

    def admissible(self, batch: Batch) -> list[Job]:
        """The waiting jobs that join now: in arrival order, while the batch has a row free and the KV budget
        holds the batch with them to the end of every row. A job that does not fit waits, and so does everyone
        behind it (no request is passed over for ever by shorter ones)."""
        if self.adapters is not None:  # versions nothing addresses any more go once their rows have ended
            waiting = {job.adapter for job in self.waiting if job.adapter}  # queued before a swap: kept placeable
            self.adapters.sweep({job.adapter for job in batch.jobs if job.adapter}, waiting)
        arrivals: list[Job] = []
        held: list[Job] = []  # their adapter has no slot now: they keep their place, the others go on
        while self.waiting and len(batch.jobs) + len(arrivals) < self.max_batch:
            job = self.waiting[0]
            if job.cancelled.is_set():
                self.waiting.popleft()
                continue
            if (batch.jobs or arrivals) and batch.projected_tokens([*arrivals, job]) > self.kv_tokens:
                break
            self.waiting.popleft()
            placed = self.place(job, batch.jobs, arrivals)
            if placed:
                arrivals.append(job)
            elif placed is False:
                held.append(job)
        self.waiting.extendleft(reversed(held))
        return arrivals

    def place(self, job: Job, running: list[Job], arrivals: list[Job]) -> bool | None:
        """Whether ``job``'s adapter is loaded (loading it if the budget allows); False: not now (it waits,
        and past its deadline it is answered 503); None: it never will be (the job was answered)."""
        if job.adapter is None:
            return True
        if self.adapters is None:
            job.finish = "error"
            job.emit("error", {"message": "this engine serves no adapters", "status": 400})
            return None
        try:
            return self.adapters.place(job.adapter, {j.adapter for j in (*running, *arrivals) if j.adapter})
        except LadleError as exc:
            job.finish = "error"
            job.emit("error", {"message": str(exc), "status": 503, "code": "adapter_unavailable"})
            return None

    def forward(self, jobs: list[Job], **inputs):
        """The model's forward over rows of ``jobs``, each on its own adapter when adapters are served."""
        if self.adapters is None:
            return self.model(**inputs)
        with self.adapters.rows_of([job.adapter for job in jobs]):
            return self.model(**inputs)


def fail(jobs: list[Job], exc: Exception) -> None:
    """End ``jobs`` that are still running with ``exc``."""
    for job in jobs:
        if job.finish is None:
            job.finish = "error"
            job.emit("error", {"message": f"{type(exc).__name__}: {exc}"})


def check_cache_layers(config) -> None:
    """Refuse a model whose decoder has layers the engine cannot batch (their cache is not keys and values).

    Raises:
        LadleError: naming the layer types and the fix.
    """
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    kinds = set(getattr(text, "layer_types", None) or ["full_attention"])
    if not kinds <= KV_LAYER_TYPES:
        raise LadleError(
            f"serve.backend = transformers: model_type {getattr(config, 'model_type', '?')!r} has decoder layers of "
            f"type {', '.join(sorted(kinds - KV_LAYER_TYPES))}, whose cache the batching engine cannot join or split "
            f"(it handles {', '.join(sorted(KV_LAYER_TYPES))}). Serve it with a backend that implements its "
            "cache, or a model with attention layers only."
        )


def kv_of(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's ``(keys, values)``, ``[rows, heads, width, dim]``."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def cache_of(kv: list[tuple[torch.Tensor, torch.Tensor]]):
    """A ``DynamicCache`` holding ``kv``, built by transformers' own constructor (each layer ``update``d)."""
    from transformers import DynamicCache

    return DynamicCache(ddp_cache_data=kv)


def plain_rollouts(jobs: list[Job], logits: torch.Tensor) -> dict[int, tuple[torch.Tensor, ...]]:
    """The rows of rollouts drawn by their temperature alone (no penalty, bias, grammar, top-k or top-p): each
    one's log-probabilities at its temperature, their probabilities and running sums (what ``draw`` reads), from
    one pass over the batch per temperature. Row by row that was a softmax to draw from, a log-softmax to keep
    and a running sum, each its own pass and dispatch (of a step's 64 rows on the tiny model, most of the
    choosing). A row's values do not depend on its neighbours: the normalisation runs along each row alone."""
    width = logits.shape[-1]
    by_temperature: dict[float, list[int]] = {}
    for row, job in enumerate(jobs):
        if (
            job.finish is None
            and job.sampled is not None
            and job.temperature > 0
            and not job.adjusts
            and job.constraint is None
            and not 0 < job.top_k < width
            and job.top_p >= 1.0
        ):
            by_temperature.setdefault(job.temperature, []).append(row)
    out = {}
    for temperature, rows in by_temperature.items():
        logps = torch.log_softmax(logits[rows].float() / temperature, dim=-1)
        probs = logps.exp()
        cdfs = torch.cumsum(probs, dim=-1, dtype=torch.float64)
        out.update({row: (logps[i], probs[i], cdfs[i]) for i, row in enumerate(rows)})
    return out


class Batch:
    """The running requests and their shared KV cache: rows left-padded to a common length."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.jobs: list[Job] = []
        self.cache = None  # DynamicCache of full-width layers, [rows, heads, width, dim] per layer
        self.mask = torch.zeros((0, 0), dtype=torch.long)  # 1 where a row has a real token
        self.last = torch.zeros((0, 1), dtype=torch.long)  # each row's newest token, the next step's input

    def admit(self, jobs: list[Job]) -> None:
        """Prefill the arrivals together (left-padded; those resuming an earlier turn's keys and values, only
        what follows them), take each one's first token, and add to the batch those that have not already ended."""
        for job in jobs:
            if job.echo and job.logprobs is not None and job.prompt_logprobs is None:
                job.prompt_logprobs = self.prompt_logprobs(job)
        fresh = [job for job in jobs if job.resume is None]
        resumed = [job for job in jobs if job.resume is not None]
        if fresh:
            self.take(fresh, *self.prefill(fresh))
        if resumed:
            self.take(resumed, *self.prefill_resumed(resumed))

    def take(self, jobs: list[Job], logits: torch.Tensor, cache, mask: torch.Tensor) -> None:
        """Choose each prefilled row's first token and join the batch with those that go on."""
        self.choose(jobs, logits)
        going = [row for row, job in enumerate(jobs) if job.finish is None]
        keep_kv(jobs, cache, mask)
        if not going:
            return
        if len(going) < len(jobs):
            cache.batch_select_indices(torch.tensor(going, device=self.engine.device))
        self.join([jobs[row] for row in going], cache, mask[going])

    def prefill_resumed(self, jobs: list[Job]) -> tuple[torch.Tensor, object, torch.Tensor]:
        """Prefill rows that resume an earlier turn: each one's kept keys and values left-padded to one width, then
        the tokens after them left-padded to one width (the padding between is masked, the positions counted from
        the real tokens), so each row's next-token logits are those of one prefill of its whole ids."""
        past = max(job.resume[1] for job in jobs)
        rest = [job.ids[job.resume[1] :] for job in jobs]
        width = max(len(r) for r in rest)
        layers = len(jobs[0].resume[0])
        kv = [
            (
                torch.cat([pad_left(job.resume[0][n][0], past) for job in jobs]),
                torch.cat([pad_left(job.resume[0][n][1], past) for job in jobs]),
            )
            for n in range(layers)
        ]
        ids = torch.full((len(jobs), width), self.engine.pad, dtype=torch.long)
        mask = torch.zeros((len(jobs), past + width), dtype=torch.long)
        for row, (job, tokens) in enumerate(zip(jobs, rest, strict=True)):
            ids[row, width - len(tokens) :] = torch.tensor(tokens)
            mask[row, past - job.resume[1] : past] = 1
            mask[row, past + width - len(tokens) :] = 1
            job.resume = None  # handed over: the batch's cache holds it now
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)[:, past:]
        cache = cache_of(kv)
        return self.next_logits(jobs, ids, mask, positions, cache), cache, mask

    def next_logits(self, jobs: list[Job], ids, mask, positions, cache) -> torch.Tensor:
        """One prefill forward of ``ids`` into ``cache``: each row's next-token logits only (``[rows, vocab]``, not
        one per prompt position)."""
        device = self.engine.device
        with torch.no_grad():
            return self.engine.forward(
                jobs,
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                position_ids=positions.to(device),
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            ).logits[:, -1, :]

    def prefill(self, jobs: list[Job]) -> tuple[torch.Tensor, object, torch.Tensor]:
        """Prefill fresh rows: their prompts left-padded to one width; the logits, cache and mask of every row."""
        from transformers import DynamicCache

        device = self.engine.device
        # Arrivals with the same prompt on the same adapter (a GRPO group, a request's n choices) are prefilled once:
        # each gets a copy of that row's cache and logits, so the group's prefill costs one prompt, not n.
        first: dict[tuple, int] = {}
        which = [first.setdefault((job.adapter, tuple(job.ids)), row) for row, job in enumerate(jobs)]
        distinct = [jobs[row] for row in first.values()]
        width = max(len(job.ids) for job in distinct)
        ids = torch.full((len(distinct), width), self.engine.pad, dtype=torch.long)
        mask = torch.zeros((len(distinct), width), dtype=torch.long)
        for row, job in enumerate(distinct):
            ids[row, width - len(job.ids) :] = torch.tensor(job.ids)
            mask[row, width - len(job.ids) :] = 1
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        cache = DynamicCache()  # no config: every layer full width (see the module's docstring)
        logits = self.next_logits(distinct, ids, mask, positions, cache)
        if len(distinct) < len(jobs):
            order = {row: i for i, row in enumerate(first.values())}
            index = torch.tensor([order[row] for row in which], dtype=torch.long)
            logits, mask = logits[index.to(logits.device)], mask[index]
            on = index.to(device)
            cache = cache_of([(k.index_select(0, on), v.index_select(0, on)) for k, v in kv_of(cache)])
        return logits, cache, mask

    def prompt_logprobs(self, job: Job) -> list[dict]:
        """Each prompt token's log-probability given the tokens before it (the first has none) and its
        ``job.logprobs`` likeliest alternatives: one forward over the prompt alone, every position's logits
        (the server bounded their size: ``echo_logits_bytes``)."""
        tokenizer = self.engine.tokenizer
        with torch.no_grad():
            logits = self.engine.forward([job], input_ids=torch.tensor([job.ids], device=self.engine.device)).logits[0]
        entries = [{**token_entry(tokenizer, job.ids[0], None), "top_logprobs": None}]
        for position, token in enumerate(job.ids[1:]):
            entries.append(logprob_entry(tokenizer, job, logits[position], token))
        return entries

    def join(self, jobs: list[Job], cache, mask: torch.Tensor) -> None:
        """Add prefilled rows (their cache and mask) to the batch, left-padding either side to one width."""
        width = max(self.mask.shape[1], mask.shape[1])
        if self.cache is None:
            self.cache = cache
        else:
            self.cache = cache_of(
                [
                    (
                        torch.cat([pad_left(k, width), pad_left(k2, width)]),
                        torch.cat([pad_left(v, width), pad_left(v2, width)]),
                    )
                    for (k, v), (k2, v2) in zip(kv_of(self.cache), kv_of(cache), strict=True)
                ]
            )
        self.mask = torch.cat([pad_mask(self.mask, width), pad_mask(mask, width)])
        self.last = torch.cat([self.last, torch.tensor([[job.tokens[-1]] for job in jobs])])
        self.jobs += jobs

    def step(self) -> None:
        """One decode step for every row, then drop the rows that ended."""
        device = self.engine.device
        self.mask = torch.cat([self.mask, torch.ones((len(self.jobs), 1), dtype=torch.long)], dim=1)
        positions = self.mask.sum(dim=1, keepdim=True) - 1
        with torch.no_grad():
            logits = self.engine.forward(
                self.jobs,
                input_ids=self.last.to(device),
                attention_mask=self.mask.to(device),
                position_ids=positions.to(device),
                past_key_values=self.cache,
                use_cache=True,
            ).logits[:, -1, :]
        self.choose(self.jobs, logits)
        self.last = torch.tensor([[job.tokens[-1] if job.tokens else self.engine.pad] for job in self.jobs])
        keep_kv(self.jobs, self.cache, self.mask)
        keep = [row for row, job in enumerate(self.jobs) if job.finish is None]
        if len(keep) < len(self.jobs):
            self.select(keep)

    def projected_tokens(self, arrivals: list[Job]) -> int:
        """KV columns the batch would hold at most with ``arrivals`` joined: every row padded to the widest,
        and the width growing one column a step until the row with the most tokens left ends."""
        rows = len(self.jobs) + len(arrivals)
        width = max([self.mask.shape[1], *(len(job.ids) for job in arrivals)])
        left = max(
            [*(job.max_new_tokens - len(job.tokens) for job in self.jobs), *(j.max_new_tokens for j in arrivals)]
        )
        return rows * (width + left)

    def choose(self, jobs: list[Job], logits: torch.Tensor) -> None:
        """Each row's next token by its own sampling (greedy: the argmax), fed to its stop logic; ended rows are
        told so. A row whose sampling fails ends with an error alone: its neighbours go on."""
        tokens = logits.argmax(dim=-1).tolist()
        stopper = RowStop(jobs, self.engine.tokenizer, self.engine.eos)
        plain = plain_rollouts(jobs, logits)
        for row, job in enumerate(jobs):
            if job.finish is not None:
                continue
            try:
                scores = adjusted(job, logits[row]) if job.adjusts else logits[row]
                if job.constraint is not None:
                    scores = job.constraint.masked(scores)
                if row in plain:
                    token = draw(plain[row][1], job.generator_on(logits.device), plain[row][2])
                elif job.temperature > 0:
                    token = sample(job, scores)
                else:
                    token = int(scores.argmax()) if job.adjusts or job.constraint else int(tokens[row])
                complete = job.constraint is not None and job.constraint.accept(token)
            except Exception as exc:
                job.finish = "error"
                job.emit("error", {"message": f"sampling failed: {type(exc).__name__}: {exc}"})
                continue
            if job.sampled is not None:  # a rollout: the token's log-probability as the trainer's forward scores it
                logps = plain[row][0] if row in plain else torch.log_softmax(logits[row].float() / job.temperature, -1)
                job.sampled.append(float(logps[token]))
                job.chosen.append(token)
            entry = logprob_entry(self.engine.tokenizer, job, logits[row], token) if job.logprobs is not None else None
            stopper.advance(job, token, entry)
            if complete and job.finish is None:  # the grammar is complete: nothing may follow
                job.finish = "stop"
                stopper.end(job)
            if job.finish is not None:
                finish(job)

    def select(self, rows: list[int]) -> None:
        index = torch.tensor(rows, dtype=torch.long)
        self.jobs = [self.jobs[r] for r in rows]
        self.mask, self.last = self.mask[index], self.last[index]
        if not rows:
            self.cache, self.mask = None, torch.zeros((0, 0), dtype=torch.long)
            return
        self.cache.batch_select_indices(index.to(self.engine.device))
        unused = int((self.mask.cumsum(dim=1) == 0).sum(dim=1).min())  # columns that are padding in every row
        # Rebuilding the cache copies it: trim once the dead columns are a quarter of the width, not at every
        # leave (measured on the CPU: -9 % tokens/s when every leave trimmed). The budget counts them meanwhile.
        if unused and 4 * unused >= self.mask.shape[1]:
            self.mask = self.mask[:, unused:]
            self.cache = cache_of([(k[:, :, unused:], v[:, :, unused:]) for k, v in kv_of(self.cache)])


def keep_kv(jobs: list[Job], cache, mask: torch.Tensor) -> None:
    """For each ended row that asked (``keep_kv``), its keys and values of its real tokens, copied out of the
    batch's cache before the row leaves it (``Job.kv_out``)."""
    for row, job in enumerate(jobs):
        if job.keep_kv and job.finish is not None and job.kv_out is None:
            cols = mask[row].nonzero().squeeze(1).to(cache.layers[0].keys.device)
            kv = [
                (k[row : row + 1].index_select(2, cols), v[row : row + 1].index_select(2, cols))
                for k, v in kv_of(cache)
            ]
            job.kv_out = (kv, len(cols))


def pad_left(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """``[rows, heads, length, dim]`` zero-padded on the left of the length axis to ``width``."""
    missing = width - tensor.shape[-2]
    if missing <= 0:
        return tensor
    return torch.cat([tensor.new_zeros((*tensor.shape[:-2], missing, tensor.shape[-1])), tensor], dim=-2)


def pad_mask(mask: torch.Tensor, width: int) -> torch.Tensor:
    missing = width - mask.shape[1]
    return torch.cat([torch.zeros((mask.shape[0], missing), dtype=mask.dtype), mask], dim=1) if missing > 0 else mask
