"""The training worker for ``training.objective: grpo``: the same process, launch, loading, strategy wrap,
optimizer, checkpoints and outputs as every objective (``ladle.train.worker``), with a step that samples its own
data (``ladle.train.grpo``).

A step is one batch of rollouts and ``training.rl.num_iterations`` optimizer steps over it; ``training.max_steps``
counts rollout steps, and the learning-rate schedule counts optimizer steps. A checkpoint is written after whole
steps, and a resumed step samples the same completions (each one's seed is fixed by the run's seed, the step and
its index) from the same weights.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial

import torch
from accelerate import Accelerator

from ladle import rewards as reward_fns
from ladle import strategies
from ladle.data import prompts as prompt_data
from ladle.platform import storage
from ladle.serve.engine import Engine
from ladle.serve.rows import Job
from ladle.train import (
    checkpoint,
    common,
    grpo,
    grpo_agent,
    grpo_probe,
    kernels,
    loading,
    packed_completions,
    schedule,
)
from ladle.train.runtime.base import runtime_for
from ladle.train.spec import TrainResult, TrainSpec


@dataclass
class RLSession:
    spec: TrainSpec
    accelerator: Accelerator
    model: torch.nn.Module  # as wrapped by the strategy: what the update's forward and backward go through
    policy: torch.nn.Module  # the Hugging Face (peft) model inside: what the engine samples with
    optimizer: torch.optim.Optimizer
    scheduler: object
    tokenizer: object
    engine: Engine
    rewards: list[reward_fns.Reward]
    train: list[dict]
    evals: list[dict]
    steps: int
    start: int
    reference: torch.nn.Module | None  # a frozen copy (full fine-tune with beta > 0); LoRA disables adapters
    log: object
    sharding: dict
    kernels: dict
    load_peak_mib: float
    baseline_mib: float
    packed: bool = False  # completions scored as one row of their real tokens (packed_completions)
    probe: grpo_probe.ProbeWatch | None = None  # eval.probe asked during training (ladle.train.grpo_probe)
    ended_early: int | None = None  # the step the probe's guard ended the run at
    losses: list[float] = field(default_factory=list)
    eval_before: float = 0.0
    reward_first: float = math.nan
    reward_last: float = math.nan
    gap_max: float = 0.0
    kl_last: float = math.nan
    agent: grpo_agent.Agent | None = None  # training.rl.environment: episodes through the tool host

    RESUMED = ("reward_first", "reward_last", "gap_max", "kl_last")  # what a checkpoint keeps of the figures

    def resume_extra(self) -> dict:
        """The running figures a resumed run reports as the uninterrupted one would (``checkpoint.save``)."""
        return {name: float(getattr(self, name)) for name in self.RESUMED}


def setup(spec: TrainSpec) -> RLSession:
    """Accelerator -> prompts -> rewards (checked before any weight loads) -> model (+LoRA) -> strategy wrap ->
    engine over the live modules -> scheduler -> resume -> held-out reward before."""
    from transformers import AutoTokenizer

    plan, cfg = spec.plan, spec.config
    rl = cfg.training.rl
    runtime = runtime_for(plan.strategy)
    common.one_process_group(plan)
    accelerator = Accelerator(cpu=plan.device == "cpu", **runtime.accelerator_kwargs(plan))
    if accelerator.num_processes != plan.world_size:
        raise RuntimeError(
            f"planned world size {plan.world_size} but the launcher started {accelerator.num_processes} process(es)"
        )
    common.warm_imports(runtime)
    torch.manual_seed(cfg.training.seed)
    loaded_rewards = reward_fns.load_all(rl.rewards, spec.reward_files)
    tokenizer = AutoTokenizer.from_pretrained(spec.base_dir)
    agent = grpo_agent.start(
        rl, spec.reward_files, tokenizer, spec.config.data.seq_len
    )  # checked, its host started, before any weight loads
    try:
        return setup_with(spec, accelerator, runtime, loaded_rewards, tokenizer, agent)
    except BaseException:
        if agent is not None:
            agent.close()
        raise


def setup_with(spec: TrainSpec, accelerator, runtime, loaded_rewards, tokenizer, agent) -> RLSession:
    plan, cfg = spec.plan, spec.config
    rl = cfg.training.rl
    train = prompt_data.read_split(spec.dataset.url, spec.dataset.shards["train"])
    evals = prompt_data.read_split(spec.dataset.url, spec.dataset.shards.get("eval", []))
    per_step = plan.global_batch_size // rl.num_generations
    if len(train) < per_step:
        raise RuntimeError(
            f"{len(train)} training prompts cannot fill one step of {per_step} prompts (training.global_batch_size "
            f"{plan.global_batch_size} / training.rl.num_generations {rl.num_generations})"
        )
    steps = schedule.total_steps(len(train), per_step, cfg.training.max_steps, cfg.training.epochs)
    baseline = common.peak_memory_mib(accelerator)
    model, pending, ran = common.load_model(spec, accelerator)
    reference = None
    model, optimizer = runtime.wrap(accelerator, model, lambda m: common.build_optimizer(m, cfg), plan, pending)
    if leftover := loading.meta_parameters(model):
        raise RuntimeError(f"{plan.strategy}: {len(leftover)} parameter(s) were never loaded, e.g. {leftover[0]}")
    policy = runtime.hf_model(accelerator, model)
    sharded = strategies.get(plan.strategy).shards_tensors
    if rl.beta and not cfg.training.lora.enabled:  # the starting weights: made before a checkpoint is resumed
        reference = runtime.frozen_copy(accelerator, policy, spec.base_dir, plan)
    ran.update(
        fused_loss="off: grpo scores each sampled token itself",
        packed_attention="off: grpo rows are prompt and completion, padded and masked",
        rollouts="ladle's batching engine on the live weights, in this process"
        + (", gathered whole for each step's rollouts" if sharded else "")
        + (", each adapted layer's weight and adapter merged into one matrix" if plan.merged_rollouts else ""),
        reference=reference_words(cfg.training.lora.enabled, rl.beta, sharded),
    )
    ran["lora_fused"] = kernels.fuse_lora(policy, plan.kernels)
    packed, ran["padding_free"] = packed_completions.resolve(
        plan.kernels,
        cfg.training.kernels.padding_free,
        packed_completions.config_of(policy),
        not grpo.shares_prompts(plan),
    )
    sharding = runtime.check_applied(accelerator, model, plan)
    local = plan.global_batch_size // accelerator.num_processes
    engine = Engine(policy, tokenizer, plan.device if plan.device == "cpu" else accelerator.device, local, thread=False)
    common.release_freed_memory(accelerator)
    load_peak = common.peak_memory_mib(accelerator)
    scheduler = common.build_scheduler(optimizer, cfg, steps * rl.num_iterations)
    state = checkpoint.load_latest(
        accelerator, storage.join(spec.run_url, "checkpoints"), model, optimizer, scheduler, plan, runtime
    )
    log = common.mlflow_logger(spec, accelerator)
    s = RLSession(
        spec,
        accelerator,
        model,
        policy,
        optimizer,
        scheduler,
        tokenizer,
        engine,
        loaded_rewards,
        train,
        evals,
        steps,
        state.step if state else 0,
        reference,
        log,
        sharding,
        ran,
        load_peak,
        baseline,
        packed,
    )
    s.agent = agent
    s.probe = grpo_probe.watch_for(cfg, tokenizer, plan.strategy)
    if state:
        s.losses, s.eval_before = list(state.losses), state.eval_before
        for name in RLSession.RESUMED:
            setattr(s, name, float(state.extra.get(name, getattr(s, name))))
    else:
        s.eval_before = -held_out_reward(s, "heldout-before.jsonl")
        log({"eval_reward": -s.eval_before}, 0)
    if s.probe is not None:  # a resumed run's start is the resumed weights' probe (the report says from which step)
        grpo_probe.check(s, s.probe, s.start, lambda: rollout_weights(s))
    return s


def held_out_reward(s: RLSession, log_as: str | None = None) -> float:
    """The mean weighted reward of one greedy completion (an agent's: one greedy episode) per held-out prompt
    (every rank's share gathered); NaN without held-out prompts. ``log_as``: the agent's episode log to keep them
    in."""
    from accelerate.utils import gather_object

    acc, rl = s.accelerator, s.spec.config.training.rl
    if not s.evals:
        return math.nan
    mine = s.evals[acc.process_index :: acc.num_processes]
    values: list[float] = []
    jobs = [Job(ids=list(row["ids"]), max_new_tokens=rl.max_completion_tokens) for row in mine]
    records: list[dict] | None = None
    with runtime_for(s.spec.plan.strategy).whole_weights(acc, s.model), sampling_weights(s):  # every rank enters
        s.policy.eval()
        if s.agent is not None:
            mine, completed, records = grpo_agent.greedy(s.agent, s.engine, s.tokenizer, mine, rl)
        else:
            s.engine.run(jobs)
            # Scored as the rollouts are (and as the evaluation's gate is): the completion with the EOS that ended it.
            completed = [job.tokens + ([job.stop_token] if job.stop_token is not None else []) for job in jobs]
        s.policy.train()
    if mine:
        table = reward_fns.table(s.rewards, s.tokenizer, mine, completed, episodes=records)
        summed = reward_fns.weighted_sum(s.rewards, table)
        values = [v for v in summed.tolist() if not math.isnan(v)]
        if records is not None and log_as:
            records = grpo_agent.with_rewards(records, summed)
    if records is not None and log_as:
        logs = gather_object([records]) if acc.num_processes > 1 else [records]
        s.agent.logs[log_as] = [r for part in logs for r in part]
    every = gather_object([values]) if acc.num_processes > 1 else [values]
    flat = [v for part in every for v in part]
    return sum(flat) / len(flat) if flat else math.nan


def rollout(s: RLSession, step: int) -> tuple[grpo.Rollouts, slice, torch.Tensor]:
    """This rank's completions of ``step``, scored, with their advantages; the step's slice of this rank and the
    every-rank reward table."""
    acc, cfg, plan = s.accelerator, s.spec.config, s.spec.plan
    rl = cfg.training.rl
    per_step = plan.global_batch_size // rl.num_generations
    chosen = grpo.step_prompts(step, len(s.train), per_step, cfg.training.seed)
    every = [s.train[i] for i in chosen for _ in range(rl.num_generations)]
    mine = grpo.local_slice(len(every), acc.process_index, acc.num_processes)
    s.policy.eval()  # no dropout while sampling; the engine runs under no_grad
    with runtime_for(plan.strategy).whole_weights(acc, s.model), sampling_weights(s):  # gathered: ZeRO-3, FSDP2
        if s.agent is not None:  # each turn's seed from (run seed, step, completion, turn)
            seed = partial(episode_seed, cfg.training.seed, step, mine.start)
            ro = grpo_agent.sample(s.agent, s.engine, s.tokenizer, every[mine], rl, seed, mine.start)
        else:
            seeds = grpo.seeds_for(cfg.training.seed, step, range(mine.start, mine.stop))
            ro = grpo.sample(s.engine, every[mine], rl, seeds)
    s.policy.train()
    table = grpo.score(s.rewards, s.tokenizer, ro, reward_fns.trainer_state(step, s.steps))
    gathered = acc.gather(table.to(acc.device)).cpu() if acc.num_processes > 1 else table
    weights = torch.tensor([r.weight for r in s.rewards], dtype=torch.float32)
    adv, summed = grpo.advantages(gathered, weights, rl.num_generations, rl.scale_rewards)
    ro.rewards, ro.advantages = table, adv[mine]
    ro.stats = reward_stats(s, gathered, summed, rl.num_generations)
    if ro.episodes is not None:  # this rank's episodes: their figures, and the log of the latest step's
        ro.stats.update(grpo_agent.stats(ro.episodes))
        s.agent.logs["last-step.jsonl"] = grpo_agent.with_rewards(ro.episodes, summed[mine])
    return ro, mine, gathered


def episode_seed(seed: int, step: int, first: int, k: int, turn: int) -> int:
    return grpo.seed_of(seed, step, first + k, turn)


@contextmanager
def rollout_weights(s: RLSession):
    """The weights every rank samples with, entered on every rank: gathered whole where sharded, merged where the
    plan says so."""
    with runtime_for(s.spec.plan.strategy).whole_weights(s.accelerator, s.model), sampling_weights(s):
        yield


@contextmanager
def sampling_weights(s: RLSession):
    """What the engine samples with: the adapters merged into a copy of the adapted weights where the plan says
    so (``training.rl.merge_for_rollouts``), the live modules as they are otherwise. The first rollouts record how
    many layers were merged (``kernels["merged_layers"]``)."""
    if not s.spec.plan.merged_rollouts:
        yield
        return
    with grpo.merged_adapters(s.policy) as merged:
        if merged == 0:
            raise RuntimeError(
                "training.rl.merge_for_rollouts: the plan merges LoRA's adapters for the rollouts, but no layer of "
                "this model is a plain LoRA linear layer peft can merge. Set training.rl.merge_for_rollouts=false."
            )
        s.kernels.setdefault("merged_layers", str(merged))  # the run's kernels are words
        yield


def reward_stats(s: RLSession, table: torch.Tensor, summed: torch.Tensor, group: int) -> dict[str, float]:
    """Each reward's mean and spread over the step, the weighted sum's, and the fraction of groups whose rewards
    are all equal (they teach nothing)."""
    stats = {}
    for j, reward in enumerate(s.rewards):
        column = table[:, j]
        stats[f"reward/{reward.name}/mean"] = float(torch.nanmean(column))
        stats[f"reward/{reward.name}/std"] = float(grpo.nanstd(column)) if column.numel() > 1 else 0.0
        stats[f"reward/{reward.name}/failed"] = float(reward.take_failed())  # this rank's completions that raised
    stats["reward"] = float(torch.nanmean(summed))
    stats["reward_std"] = float(grpo.nanstd(summed)) if summed.numel() > 1 else 0.0
    spread = grpo.nanstd(summed.view(-1, group), dim=1)
    stats["frac_reward_zero_std"] = float(torch.isclose(spread, torch.zeros_like(spread)).float().mean())
    return {k: (0.0 if math.isnan(v) else v) for k, v in stats.items()}


def reference_words(lora: bool, beta: float, sharded: bool) -> str:
    """What the KL term is measured against, in words (the run's ``kernels["reference"]``)."""
    if not beta:
        return "off (beta 0)"
    if lora:
        return "adapters disabled"
    return "a frozen copy, sharded as the trained weights" if sharded else "a frozen copy"


def frozen_logps(s: RLSession, model, ro: grpo.Rollouts, micros: list[list[int]], adapters_off: bool) -> torch.Tensor:
    """Log-probabilities of the completions under ``model`` without gradients, micro-batch by micro-batch."""
    device, rl = s.accelerator.device, s.spec.config.training.rl
    width = max(1, max(len(c) for c in ro.completion_ids))
    out = torch.zeros((len(ro.rows), width), dtype=torch.float32)
    pad, share = s.engine.pad, grpo.shares_prompts(s.spec.plan)
    for rows in micros:
        context = model.disable_adapter() if adapters_off else torch.no_grad()
        with torch.no_grad(), context:
            logps, _ = grpo.completion_logps(
                model,
                [ro.rows[i] for i in rows],
                [ro.completion_ids[i] for i in rows],
                pad,
                device,
                rl.temperature,
                share,
                s.packed,
            )
        out[rows, : logps.shape[1]] = logps.cpu()
    return out


def update(s: RLSession, ro: grpo.Rollouts, iteration: int, check: bool) -> dict[str, float]:
    """One optimizer step over this rank's completions (``micro_batch_size`` at a time); the step's loss and
    statistics (every rank's)."""
    acc, cfg, plan = s.accelerator, s.spec.config, s.spec.plan
    rl, runtime = cfg.training.rl, runtime_for(plan.strategy)
    n_local = len(ro.rows)
    micros = [list(range(i, min(i + plan.micro_batch_size, n_local))) for i in range(0, n_local, plan.micro_batch_size)]
    counts = torch.tensor([ro.tokens, n_local], dtype=torch.float64, device=acc.device)
    tokens_all, completions_all = (int(v) for v in acc.reduce(counts, "sum").tolist())
    world = acc.num_processes
    sums = {"loss": 0.0, "clipped": 0.0, "kl": 0.0, "gap": 0.0}
    share = grpo.shares_prompts(plan)
    for m, rows in enumerate(micros):
        last = m == len(micros) - 1
        with runtime.no_sync(acc, s.model) if not last else nullcontext():
            logps, cmask = grpo.completion_logps(
                s.model,
                [ro.rows[i] for i in rows],
                [ro.completion_ids[i] for i in rows],
                s.engine.pad,
                acc.device,
                rl.temperature,
                share,
                s.packed,
            )
            cmask = ro.loss_mask(rows, cmask)  # an episode's tool blocks are context, not the model's
            width = logps.shape[1]
            old = ro.old_logps[rows, :width].to(acc.device) if ro.old_logps is not None else logps.detach()
            ref = ro.ref_logps[rows, :width].to(acc.device) if ro.ref_logps is not None else None
            adv = ro.advantages[rows].to(acc.device)
            per_token, stats = grpo.per_token_loss(logps, old, adv, cmask, rl, ref)
            loss = grpo.reduce(per_token, cmask, rl, completions_all, tokens_all)
            runtime.backward(acc, s.model, loss * world, boundary=last)
        sums["loss"] += float(loss.detach())
        sums["clipped"] += stats.get("clipped", 0.0)
        sums["kl"] += stats.get("kl", 0.0)
        if check:
            sampled = grpo.padded([ro.sampler_logps[i] for i in rows], width).to(acc.device)
            gap = ((logps.detach() - sampled).abs() * cmask).max()
            sums["gap"] = max(sums["gap"], float(gap))
    totals = torch.tensor([sums["loss"], sums["clipped"], sums["kl"]], dtype=torch.float64, device=acc.device)
    loss_all, clipped_all, kl_all = acc.reduce(totals, "sum").tolist()
    if not math.isfinite(loss_all):
        raise common.NonFiniteLoss(
            f"the grpo loss of step {len(s.losses) + 1} (iteration {iteration + 1}) is {loss_all}: its gradients were "
            "not applied and the run stops (a retry resumes from its last complete checkpoint). Lower training.lr, "
            "or check the rewards for extreme values."
        )
    runtime.optimizer_step(acc, s.model, s.optimizer, cfg.training.max_grad_norm)
    s.scheduler.step()
    out = {"loss": loss_all}
    if rl.loss != "sapo":  # sapo's gate is soft: nothing is clipped (TRL logs no clip ratio for it)
        out["clip_ratio"] = clipped_all / max(tokens_all, 1)
    if rl.beta:
        out["kl"] = kl_all / max(tokens_all, 1)
    if check:
        gap = torch.tensor([sums["gap"]], dtype=torch.float64, device=acc.device)
        out["rollout_logprob_gap"] = float(acc.reduce(gap, "max")[0]) if world > 1 else sums["gap"]
    return out


def train_step(s: RLSession, step: int) -> dict[str, float]:
    """Rollouts, rewards, advantages and ``num_iterations`` updates; what to log of the step."""
    rl = s.spec.config.training.rl
    plan = s.spec.plan
    ro, _, _ = rollout(s, step)
    began = time.perf_counter()
    n_local = len(ro.rows)
    micros = [list(range(i, min(i + plan.micro_batch_size, n_local))) for i in range(0, n_local, plan.micro_batch_size)]
    if rl.num_iterations > 1:  # the ratio's denominator: the weights that sampled, before this step's updates
        ro.old_logps = frozen_logps(s, s.policy, ro, micros, adapters_off=False)
    if rl.beta:
        lora = s.spec.config.training.lora.enabled
        ro.ref_logps = frozen_logps(s, s.policy if lora else s.reference, ro, micros, adapters_off=lora)
    check = rl.logprob_check_every > 0 and step % rl.logprob_check_every == 0
    metrics: dict[str, float] = {}
    for iteration in range(rl.num_iterations):
        got = update(s, ro, iteration, check and iteration == 0)
        if iteration == 0:
            metrics.update(got)
        else:
            metrics[f"loss_iteration_{iteration + 1}"] = got["loss"]
    update_s = time.perf_counter() - began
    counts = torch.tensor(
        [ro.tokens, len(ro.rows), sum(ro.truncated), ro.seconds, max((len(c) for c in ro.completion_ids), default=0)],
        dtype=torch.float64,
        device=s.accelerator.device,
    )
    total = s.accelerator.reduce(counts[:4].clone(), "sum").tolist()
    longest = (
        float(s.accelerator.reduce(counts[4:].clone(), "max")[0])
        if s.accelerator.num_processes > 1
        else float(counts[4])
    )
    tokens, completions, truncated, gen_s = total
    gen_s /= s.accelerator.num_processes  # ranks sample at once: the step waited about their mean
    metrics.update(ro.stats)
    metrics.update(
        completion_length=tokens / max(completions, 1),
        completion_length_max=longest,
        truncated_fraction=truncated / max(completions, 1),
        generation_s=gen_s,
        update_s=update_s,
        generation_tokens_per_s=tokens / gen_s if gen_s else 0.0,
        completion_tokens=tokens,
    )
    return metrics


def train_loop(s: RLSession) -> tuple[int, float]:
    acc, cfg = s.accelerator, s.spec.config
    common.emit_start(s)
    s.model.train()
    tokens, seconds = 0, 0.0
    for step in range(s.start, s.steps):
        began = time.perf_counter()
        m = train_step(s, step)
        common.release_freed_memory(acc, at_most_every_s=common.TRIM_EVERY_S)
        elapsed = time.perf_counter() - began
        tokens, seconds = tokens + int(m["completion_tokens"]), seconds + elapsed
        s.losses.append(m["loss"])
        s.reward_first = m["reward"] if math.isnan(s.reward_first) else s.reward_first
        s.reward_last = m["reward"]
        s.gap_max = max(s.gap_max, m.get("rollout_logprob_gap", 0.0))
        s.kl_last = m.get("kl", s.kl_last)
        lr = s.scheduler.get_last_lr()[0]
        step_tps = m["completion_tokens"] / elapsed
        s.log({"train_loss": m["loss"], "lr": lr, "tokens_per_s": step_tps, **m}, step + 1)
        shown = (
            "reward",
            "reward_std",
            "rollout_logprob_gap",
            "clip_ratio",
            "kl",
            "completion_length",
            "generation_s",
            "update_s",
        )
        common.emit(
            acc,
            "step",
            step=step + 1,
            steps=s.steps,
            loss=round(m["loss"], 6),
            lr=lr,
            tokens_per_s=round(step_tps, 1),
            elapsed_s=round(seconds, 3),
            **{k: round(m[k], 6) for k in shown if k in m},
        )
        if cfg.training.eval_every and (step + 1) % cfg.training.eval_every == 0 and step + 1 < s.steps:
            s.log({"eval_reward": held_out_reward(s)}, step + 1)
        due = s.probe is not None and (step + 1) % s.probe.every == 0 and step + 1 < s.steps
        if due and grpo_probe.check(s, s.probe, step + 1, lambda: rollout_weights(s)):
            s.ended_early = step + 1
            common.emit(acc, "probe_guard", step=step + 1, why=s.probe.breach)
            break
        common.checkpoint_if_due(s, step + 1)
    return tokens, seconds


def finish(s: RLSession, tokens: int, seconds: float) -> TrainResult:
    acc = s.accelerator
    last = s.probe is not None and s.ended_early is None and s.steps > s.start  # the last check: the guard's too
    if last and grpo_probe.check(s, s.probe, s.steps, lambda: rollout_weights(s)):
        common.emit(acc, "probe_guard", step=s.steps, why=s.probe.breach)
    after = held_out_reward(s, "heldout-after.jsonl")
    s.log({"eval_reward": after}, s.steps)
    if s.agent is not None and acc.is_main_process:
        s.kernels["episode_logs"] = ", ".join(
            grpo_agent.write_logs(s.agent, s.spec.run_url, s.spec.tracking_uri, s.spec.mlflow_run_id)
        )
    parity_logps, parity_dtype = common.training_parity(  # the served model is checked against these
        acc, s.model, s.spec
    )
    adapter_url, model_url = common.save_outputs(acc, s.model, s.spec)
    losses = s.losses
    nan_free = lambda v: 0.0 if math.isnan(v) else v  # noqa: E731 (JSON has no NaN)
    result = TrainResult(
        strategy=s.spec.plan.strategy,
        world_size=acc.num_processes,
        backend=torch.distributed.get_backend() if torch.distributed.is_initialized() else "none",
        steps=s.ended_early or s.steps,
        resumed_from_step=s.start,
        train_losses=losses,
        train_loss_first=losses[0] if losses else 0.0,
        train_loss_last=losses[-1] if losses else 0.0,
        eval_loss_before=nan_free(s.eval_before),
        eval_loss_after=nan_free(-after),
        real_tokens=tokens,
        tokens_per_s=tokens / seconds if seconds else 0.0,
        train_seconds=seconds,
        adapter_url=adapter_url,
        model_url=model_url,
        sharding=s.sharding,
        peak_memory_mib=common.peak_memory_mib(acc),
        load_peak_memory_mib=s.load_peak_mib,
        baseline_memory_mib=s.baseline_mib,
        weights_dtype=s.spec.plan.dtype if s.spec.plan.device == "cuda" else "float32",
        rl={
            "eval_reward_before": nan_free(-s.eval_before),
            "eval_reward_after": nan_free(after),
            "reward_first_step": nan_free(s.reward_first),
            "reward_last_step": nan_free(s.reward_last),
            "rollout_logprob_gap_max": s.gap_max,
            **({} if math.isnan(s.kl_last) else {"kl_last_step": s.kl_last}),
            **(s.probe.summary() if s.probe is not None else {}),
        },
        kernels=s.kernels,
        tool_parity=(
            grpo_agent.parity_cases(
                s.agent.logs.get("heldout-after.jsonl", []),
                s.agent.env.tools,
                s.spec.config.training.rl.max_completion_tokens,
            )
            if s.agent is not None
            else []
        ),
        parity_logps=parity_logps,
        parity_dtype=parity_dtype,
    )
    return common.report_done(acc, s.spec, result)


def run(spec: TrainSpec) -> TrainResult:
    session = setup(spec)
    common.KEPT.append(session)
    try:
        tokens, seconds = train_loop(session)
        return finish(session, tokens, seconds)
    finally:
        if session.agent is not None:
            session.agent.close()
