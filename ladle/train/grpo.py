"""Online RL from checkable rewards (``training.objective: grpo``): rollouts by ladle's own batching engine on the
policy's live weights, rewards, group advantages and the GRPO family's losses, as TRL 1.16's ``GRPOTrainer``
defines them.

A step:

1. **Prompts.** ``global_batch_size / num_generations`` prompts, in the seeded order every objective reads rows
   in (``ladle.train.schedule``); each is repeated ``num_generations`` times, and each rank takes its contiguous
   slice of those completions (a group may span ranks, as in TRL).
2. **Rollouts.** The rank's slice is sampled by ``ladle.serve.engine.Engine`` (continuous batching, a KV cache,
   each completion its own seeded generator) driven on the training thread over the very modules being trained:
   the peft model with its live adapters, or the full model; nothing is copied or reloaded. Each completion's seed
   comes from (training.seed, step, its index), so a resumed step samples what the first attempt sampled. A
   group's prompt is prefilled once and its cache copied to the group's rows.
3. **Rewards.** Each reward is called on this rank's completions (TRL's convention, ``ladle.rewards``), the
   table gathered from every rank, and the advantages computed over whole groups (``advantages``).
4. **Update.** ``num_iterations`` optimizer steps over the rollouts, micro-batch by micro-batch: each completion's
   per-token log-probabilities at the sampling temperature (each distinct prompt run once, its completions scored
   on its cache: ``completion_logps``), the importance ratio against the rollout's (token or
   sequence level), the loss type's clipping and normalisation (``per_token_loss``, ``reduce``), and the k3 KL to
   the reference where ``beta`` > 0 (LoRA: the adapters disabled; a full fine-tune: a frozen copy).
5. **Checks.** The first update's forward scores the very tokens the engine sampled, on the same weights: the
   largest difference between the two log-probabilities is logged as ``rollout_logprob_gap`` (a sampler that
   drifted from the trainer shows here first).

Normalisation is over the whole step (all ranks), so the loss does not change with the world size or the
micro-batch: grpo and sapo average each completion's token mean over the step's completions, dr_grpo divides the
token sum by completions x max_completion_tokens, dapo and cispo by the step's completion tokens. With one process
and one micro-batch every one equals TRL's (``tests/train/test_grpo.py`` holds them to it).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial

import torch

from ladle import rewards as reward_fns
from ladle.config.training import RLConfig
from ladle.serve.rows import Job
from ladle.train import schedule


@dataclass
class Rollouts:
    """One step's completions on this rank, in order, and what sampling them cost."""

    rows: list[dict]  # the prompt row of each completion (its prompt, columns and ids)
    completion_ids: list[list[int]]
    sampler_logps: list[list[float]]  # the engine's log-probability of each sampled token, at the temperature
    truncated: list[bool]
    seconds: float = 0.0
    rewards: torch.Tensor | None = None  # [completions, rewards] of this rank (NaN: not applicable)
    advantages: torch.Tensor | None = None  # [completions]
    old_logps: torch.Tensor | None = None  # [completions, width]: where num_iterations > 1
    ref_logps: torch.Tensor | None = None  # [completions, width]: where beta > 0
    stats: dict = field(default_factory=dict)
    masks: list[list[int]] | None = None  # an agent's episodes: 1 on the model's tokens, 0 on the tools' blocks
    episodes: list[dict] | None = None  # an agent's episodes' records (``ladle.agents.episodes.Episode.record``)

    @property
    def tokens(self) -> int:
        """The tokens the model wrote (an episode's tool blocks are not counted)."""
        if self.masks is not None:
            return sum(sum(m) for m in self.masks)
        return sum(len(c) for c in self.completion_ids)

    def loss_mask(self, rows: list[int], cmask: torch.Tensor) -> torch.Tensor:
        """``cmask`` (the completions' real tokens) times the episodes' masks: where the loss applies (TRL's
        ``completion_mask * tool_mask``)."""
        if self.masks is None:
            return cmask
        tool = torch.zeros_like(cmask)
        for r, i in enumerate(rows):
            m = self.masks[i][: cmask.shape[1]]
            if m:
                tool[r, : len(m)] = torch.tensor(m, dtype=cmask.dtype)
        return cmask * tool


def step_prompts(step: int, prompts: int, per_step: int, seed: int) -> list[int]:
    """The prompt indices of ``step``: the seeded, epoch-shuffled order every objective reads rows in."""
    return schedule.global_batch_rows(step, prompts, per_step, seed)


def local_slice(total: int, rank: int, world: int) -> slice:
    share = total // world
    return slice(rank * share, (rank + 1) * share)


def sample(engine, rows: list[dict], rl: RLConfig, seeds: list[int]) -> Rollouts:
    """Complete ``rows`` (one completion each, repeated rows being a group) with ``engine`` on the calling thread.

    Raises:
        RuntimeError: the engine failed a completion (its message).
    """
    began = time.perf_counter()
    failures: list[str] = []

    def on_event(kind: str, data: dict) -> None:
        if kind == "error":
            failures.append(str(data.get("message")))

    jobs = [
        Job(
            ids=list(row["ids"]),
            max_new_tokens=rl.max_completion_tokens,
            temperature=rl.temperature,
            top_p=rl.top_p,
            top_k=rl.top_k,
            seed=seed,
            sampled=[],
            writes_text=False,  # the rewards decode the completion's token ids themselves
            emit=on_event,
        )
        for row, seed in zip(rows, seeds, strict=True)
    ]
    engine.run(jobs)
    if failures:
        raise RuntimeError(f"rollout sampling failed: {failures[0]}")
    return Rollouts(
        rows=rows,
        completion_ids=[list(job.chosen) for job in jobs],
        sampler_logps=[list(job.sampled) for job in jobs],
        truncated=[job.finish == "length" for job in jobs],
        seconds=time.perf_counter() - began,
    )


@contextmanager
def merged_adapters(model) -> Iterator[int]:
    """While the context lasts, each plain LoRA layer of ``model`` computes ``x @ (W + scale * B @ A)^T`` with one
    matrix made now from its live tensors (``get_delta_weight``), instead of the base product plus the adapter's
    two: a decode step of the tiny model takes 4.7 ms instead of 6.3 on a CPU. ``W`` itself is never written
    (merging in place and subtracting after would leave the frozen base a rounding away from what it was), so the
    matrices are a copy of the adapted weights, freed at the end. A layer peft computes otherwise (a variant such
    as DoRA, a quantized base, several or disabled adapters) keeps its own forward. Yields how many were merged."""
    from ladle.train.lora_fused import plain_lora

    patched = []
    with torch.no_grad():
        for module in model.modules():
            if not plain_lora(module) or module.merged or module.disable_adapters:
                continue
            active = [name for name in module.active_adapters if name in module.lora_A]
            if len(active) != 1 or active[0] in module.lora_variant or type(module.base_layer) is not torch.nn.Linear:
                continue
            base = module.base_layer
            weight = base.weight + module.get_delta_weight(active[0]).to(base.weight.dtype)
            patched.append(module)
            # An instance attribute shadows the class's forward until it is deleted.
            module.forward = partial(torch.nn.functional.linear, weight=weight, bias=base.bias)
    try:
        yield len(patched)
    finally:
        for module in patched:
            del module.forward


def seeds_for(seed: int, step: int, indices: range) -> list[int]:
    """Each completion's sampling seed: the same for the same (run seed, step, completion), on any attempt.

    A hash of the three into 63 bits, so any ``training.seed`` (a date, ``123456789``, a negative number) gives a
    seed torch's generator takes (``manual_seed`` refuses what is outside ``[-2**63, 2**64)``); arithmetic on the
    seed itself overflowed that range from ``training.seed`` ~1.85e7 on, and every rollout failed."""
    return [seed_of(seed, step, i) for i in indices]


def seed_of(*parts: int) -> int:
    digest = hashlib.blake2b(":".join(str(int(p)) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1  # 63 bits: non-negative, within every generator's range


def score(loaded: list[reward_fns.Reward], tokenizer, ro: Rollouts, state=None) -> torch.Tensor:
    """``[completions, rewards]``: each reward's value (NaN where it does not apply) on this rank's completions
    (``state``: TRL's ``trainer_state``, ``reward_fns.trainer_state``)."""
    return reward_fns.table(loaded, tokenizer, ro.rows, ro.completion_ids, state, ro.episodes)


def nanstd(values: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sample standard deviation ignoring NaN (Bessel-corrected, as TRL's ``nanstd``)."""
    mean = torch.nanmean(values, dim=dim, keepdim=True)
    variance = torch.nanmean((values - mean) ** 2, dim=dim, keepdim=True)
    count = (~torch.isnan(values)).sum(dim=dim, keepdim=True)
    out = torch.sqrt(variance * count / (count - 1))
    return out.squeeze(dim) if dim is not None else out.squeeze()


def advantages(table: torch.Tensor, weights: torch.Tensor, group: int, scale: str) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's ``sum_then_normalize``: weighted reward sum per completion (a completion no reward applies to is NaN),
    minus its group's mean, divided by the group's (``group``) or the whole step's (``batch``) standard deviation
    plus 1e-4, or not divided (``none``); NaN advantages become 0.

    Returns:
        the advantages and the summed rewards, both ``[completions]`` (the step's, every rank's).
    """
    summed = (table * weights.unsqueeze(0)).nansum(dim=1)
    summed[torch.isnan(table).all(dim=1)] = float("nan")
    grouped = summed.view(-1, group)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(group)
    if scale == "batch":
        std = nanstd(summed).expand_as(summed)
    else:
        std = nanstd(grouped, dim=1).repeat_interleave(group)
    adv = summed - mean
    if scale != "none":
        adv = adv / (std + 1e-4)
    return torch.nan_to_num(adv, nan=0.0), summed


# The loss -------------------------------------------------------------------------------------------------------


def padded_ids(seqs: list[list[int]], pad: int, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``seqs`` as one ``[rows, longest]`` tensor padded on the left (prompts) or the right (completions), and its
    mask (1 on real tokens); at least one column."""
    width = max(1, max(len(seq) for seq in seqs))
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, seq in enumerate(seqs):
        if seq:
            span = slice(width - len(seq), width) if left else slice(0, len(seq))
            ids[i, span], mask[i, span] = torch.tensor(seq), 1
    return ids, mask


def batch_inputs(rows: list[dict], completions: list[list[int]], pad: int, device) -> tuple[torch.Tensor, ...]:
    """Prompts left-padded and completions right-padded: ``input_ids``, ``attention_mask``, the completion mask
    (``[rows, width]``), and the width of the prompt part."""
    pids, pmask = padded_ids([r["ids"] for r in rows], pad, left=True)
    cids, cmask = padded_ids(completions, pad, left=False)
    ids, mask = torch.cat([pids, cids], dim=1), torch.cat([pmask, cmask], dim=1)
    return ids.to(device), mask.to(device), cmask.float().to(device), pids.shape[1]


def token_logps(model, ids: torch.Tensor, mask: torch.Tensor, prompt_width: int, temperature: float) -> torch.Tensor:
    """Each completion token's log-probability under ``model`` at ``temperature`` (``[rows, completion width]``),
    from a forward of input ids and attention mask, as TRL's trainer scores them."""
    width = ids.shape[1] - prompt_width
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False, logits_to_keep=width + 1).logits
    logits = logits[:, :-1, :].float() / temperature  # the logits before each completion token
    targets = ids[:, prompt_width:]
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def distinct_prompts(rows: list[dict]) -> tuple[list[list[int]], list[int]]:
    """The distinct prompts of ``rows`` in order of first appearance, and each row's index among them."""
    seen: dict[tuple[int, ...], int] = {}
    which = [seen.setdefault(tuple(row["ids"]), len(seen)) for row in rows]
    return [list(ids) for ids in seen], which


def shares_prompts(plan) -> bool:
    """Whether the update runs each distinct prompt once (``completion_logps``): from the plan alone, never from
    the rows, so every rank runs as many forwards; not where activations are recomputed in the backward."""
    return not plan.gradient_checkpointing


def completion_logps(
    model,
    rows: list[dict],
    completions: list[list[int]],
    pad: int,
    device,
    temperature: float,
    share: bool = True,
    packed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each completion token's log-probability under ``model`` (``[rows, completion width]``) and the completion
    mask, as ``token_logps`` scores them; with ``share``, each distinct prompt is run once.

    A group's completions share their prompt, so scoring each completion with its own copy of the prompt spends
    most of the update's forward and backward on the same prompt tokens again (a 35-token prompt and 12-token
    completions: 8 x 47 tokens a group where 35 + 8 x 12 would do). Shared, the prompts are run alone (left-padded,
    their KV cache kept, with gradients), each prompt's keys and values are indexed out to its completions (the
    backward sums their gradients back into the prompt's), and the completions run on that cache with the same
    positions and mask as one forward of both would give them. ``share`` is off where the model recomputes its
    activations in the backward (transformers' checkpointed layers take no cache). It comes from the config, never
    from the rows: every rank must run the same number of forwards (a sharded model gathers its weights in each,
    and DDP syncs its buffers), so a micro-batch of distinct prompts runs the two forwards too.

    ``packed``: the completions run as one row of their real tokens (``ladle.train.packed_completions``; a
    micro-batch with an empty completion runs padded); still two forwards.
    """
    if not share:
        ids, mask, cmask, width = batch_inputs(rows, completions, pad, device)
        return token_logps(model, ids, mask, width, temperature), cmask
    from transformers import DynamicCache

    from ladle.serve.engine import cache_of, kv_of

    prompts, which = distinct_prompts(rows)
    pids, pmask = padded_ids(prompts, pad, left=True)
    cids, cmask = padded_ids(completions, pad, left=False)
    width_c = cids.shape[1]
    index = torch.tensor(which, device=device)
    cache = DynamicCache()
    first = model(
        input_ids=pids.to(device),
        attention_mask=pmask.to(device),
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,  # the logits of each completion's first token
    ).logits[:, -1:, :]
    pmask, cids, cmask = pmask.to(device), cids.to(device), cmask.to(device)

    # Scored in two parts and joined as log-probabilities: joining the logits would copy every position's
    # vocabulary-wide row once more.
    def scaled(logits: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        return logits if temperature == 1.0 else logits / temperature  # no copy of the logits at temperature 1

    head = torch.log_softmax(scaled(first), dim=-1).squeeze(1)  # [prompts, vocab]
    firsts = head.index_select(0, index).gather(-1, cids[:, :1]).squeeze(-1)
    if packed and all(completions):
        from ladle.train import packed_completions

        logps = packed_completions.logps(model, kv_of(cache), firsts, pmask, index, completions, device, scaled)
        return logps, cmask.float()
    shared = cache_of([(k.index_select(0, index), v.index_select(0, index)) for k, v in kv_of(cache)])
    rest = model(
        input_ids=cids,
        attention_mask=torch.cat([pmask.index_select(0, index), cmask], dim=1),
        past_key_values=shared,
        use_cache=True,
        logits_to_keep=width_c,
    ).logits[:, :-1, :]
    tail = torch.log_softmax(scaled(rest), dim=-1).gather(-1, cids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return torch.cat([firsts.unsqueeze(1), tail], dim=1), cmask.float()


def per_token_loss(
    logps: torch.Tensor,
    old: torch.Tensor,
    adv: torch.Tensor,
    cmask: torch.Tensor,
    rl: RLConfig,
    ref: torch.Tensor | None,
) -> tuple[torch.Tensor, dict]:
    """TRL 1.16's per-token loss for ``rl.loss`` (and the KL term), and its clipping statistics' sums."""
    log_ratio = logps - old
    if rl.importance_sampling == "sequence":
        log_ratio = ((log_ratio * cmask).sum(-1) / cmask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef = torch.exp(log_ratio)
    adv = adv.unsqueeze(1)
    low, high = 1 - rl.epsilon, 1 + rl.clip_high
    if rl.loss == "cispo":
        loss = -torch.clamp(coef, max=rl.clip_high).detach() * adv * logps
    elif rl.loss == "sapo":
        temps = torch.where(adv > 0, rl.sapo_temperature_pos, rl.sapo_temperature_neg)
        loss = -(torch.sigmoid(temps * (coef - 1)) * 4 / temps) * adv
    else:
        loss = -torch.min(coef * adv, torch.clamp(coef, low, high) * adv)
    stats = {}
    with torch.no_grad():  # TRL's clip statistics: cispo's is its cap on the ratio, sapo's soft gate clips nothing
        if rl.loss == "cispo":
            clipped = ((coef > rl.clip_high) & (adv > 0)).float().expand_as(cmask)
        else:
            clipped = (((coef < low) & (adv < 0)) | ((coef > high) & (adv > 0))).float().expand_as(cmask)
        if rl.loss != "sapo":
            stats["clipped"] = float((clipped * cmask).sum())
    if rl.beta:
        # k3's estimate of KL(policy || reference), times the importance ratio (TRL 1.16's default
        # use_bias_correction_kl, after DeepSeek-V3.2: its gradient is then the unbiased reverse-KL gradient)
        kl = (torch.exp(ref - logps) - (ref - logps) - 1) * coef
        loss = loss + rl.beta * kl
        stats["kl"] = float((kl.detach() * cmask).sum())
    return loss, stats


def reduce(loss: torch.Tensor, cmask: torch.Tensor, rl: RLConfig, completions: int, tokens: int) -> torch.Tensor:
    """This micro-batch's share of the step's loss: its sum under the loss type's step-wide normaliser."""
    if rl.loss in ("grpo", "sapo"):
        return ((loss * cmask).sum(-1) / cmask.sum(-1).clamp(min=1.0)).sum() / completions
    if rl.loss == "dr_grpo":
        return (loss * cmask).sum() / (completions * rl.completion_budget)
    return (loss * cmask).sum() / max(tokens, 1)  # dapo, cispo


def padded(values: list[list[float]], width: int) -> torch.Tensor:
    out = torch.zeros((len(values), width), dtype=torch.float32)
    for i, v in enumerate(values):
        if v:
            out[i, : len(v)] = torch.tensor(v[:width], dtype=torch.float32)
    return out
