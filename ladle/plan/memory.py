"""The plan's decisions that the memory model sizes: activation checkpointing, the strategy (every candidate
sized on this device), the micro-batch and the eval micro-batch, and the whole pipeline's memory (loading, a step,
the merge, serving) for the chosen layout. ``ladle.plan.planner`` runs them in order with the others."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ladle import sizing, strategies
from ladle.config import LadleConfig
from ladle.errors import LadleError
from ladle.machine.topology import Topology
from ladle.plan import kernels
from ladle.plan.model import Decision, Plan
from ladle.serve import backends
from ladle.strategies import Candidate, Strategy, Target


@dataclass(frozen=True)
class Chosen:
    """The strategy to run, the option values the sizing set for it, and every candidate it weighed."""

    strategy: Strategy
    updates: dict[str, Any]
    candidates: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True)
class Sized:
    """A candidate with its per-rank memory on this machine."""

    candidate: Candidate
    estimate: sizing.Estimate
    fits: bool

    def row(self, why: str | None = None) -> dict[str, Any]:
        est = self.estimate
        return {
            "strategy": est.strategy,
            "per_rank_gib": round(est.total / sizing.GIB, 2),
            "fits": self.fits,
            "breakdown": est.summary(),
            "why": why or self.candidate.why,
        }


def with_training(cfg: LadleConfig, **updates: Any) -> LadleConfig:
    """A copy of ``cfg`` with ``training`` fields replaced (the caller's config is left as it was)."""
    return cfg.model_copy(update={"training": cfg.training.model_copy(update=updates)})


def with_merged_rollouts(cfg: LadleConfig, merged: bool | None) -> LadleConfig:
    """A copy of ``cfg`` whose ``training.rl.merge_for_rollouts`` is ``merged`` (what the plan settled)."""
    return with_training(cfg, rl=cfg.training.rl.model_copy(update={"merge_for_rollouts": merged}))


def choose_checkpointing(cfg: LadleConfig, topo: Topology, target: Target, model: dict | None) -> Decision[bool]:
    """``training.gradient_checkpointing``, or for ``auto``: off when some strategy (the named one, if named)
    fits the device without it; on when only recomputing activations makes one fit, and when nothing fits
    either way (the strategy step then says what else to change). Layouts that split sequences across ranks
    (``Candidate.splits_sequence``) are weighed after recomputation: on when only they fit."""
    asked = cfg.training.gradient_checkpointing
    if asked != "auto":
        return Decision(bool(asked))
    capacity = device_bytes(topo, target.device, target.processes_per_machine)
    if model is None or capacity is None:
        return Decision(False)  # off; the strategy step says the size is unknown
    micro = 1 if cfg.training.micro_batch_size == "auto" else cfg.training.micro_batch_size
    explicit = cfg.parallelism.strategy
    try:
        fitting = {}
        for recompute in (False, True):
            job = sizing_job(with_training(cfg, gradient_checkpointing=recompute), model, target, micro)
            sized = size_candidates(cfg, job, topo.interconnect, capacity)
            if explicit != "auto":
                strategy = strategies.get(explicit)
                est = strategy.estimate(job, strategy.options(cfg))
                sized = [Sized(Candidate(strategy, -1, "explicit"), est, est.fits(capacity))]
            whole = [s for s in sized if not s.candidate.splits_sequence] or sized
            fitting[recompute] = next((s for s in whole if s.fits), None), min(whole, key=lambda s: s.estimate.total)
            split = next((s for s in sized if s.fits and s.candidate.splits_sequence), None)
    except LadleError:
        return Decision(False, ("activation checkpointing off (auto): the memory was not sized",))
    (plain, smallest), (recomputed, _) = fitting[False], fitting[True]
    if plain is not None:
        return Decision(
            False,
            (f"activation checkpointing off (auto): {plain.estimate.strategy} fits without recomputing activations",),
        )
    if recomputed is not None:
        return Decision(
            True,
            (
                f"activation checkpointing on (auto): nothing fits with every activation kept (the smallest, "
                f"{smallest.estimate.strategy}, needs {sizing.gib(smallest.estimate.total)}); recomputing each "
                f"layer's in backward, {recomputed.estimate.strategy} needs {recomputed.estimate.summary()}",
            ),
        )
    if split is not None:  # the last pass (with recomputation) found a layout that splits sequences
        return Decision(
            True,
            (
                f"activation checkpointing on (auto): no layout that keeps whole sequences on a rank fits, even "
                f"recomputing activations (the smallest, {smallest.estimate.strategy}, needs "
                f"{sizing.gib(smallest.estimate.total)} without recomputation); sequences are split across ranks, "
                "with recomputation",
            ),
        )
    # Nothing fits either way: recompute (the closer to fitting), so the strategy step sizes and reports that.
    return Decision(True, ("activation checkpointing on (auto): nothing fits without it, nor with it",))


def choose_eval_micro(cfg, target: Target, model, strategy: Strategy, micro: int) -> Decision[int]:
    """``training.eval_micro_batch_size``, or for ``auto`` what the strategy's memory model allows (``micro``
    when the model is not sized)."""
    asked = cfg.training.eval_micro_batch_size
    if asked != "auto":
        return Decision(asked, overrides=(f"training.eval_micro_batch_size={asked}",))
    if model is None:
        return Decision(micro)
    try:
        job = sizing_job(cfg, model, target, micro)
    except LadleError:
        return Decision(micro)
    rows, why = strategy.eval_micro_batch(job, strategy.options(cfg))
    return Decision(rows, (f"eval micro-batch {rows}: {why}",))


def host_bytes() -> int | None:
    """This machine's physical memory (None when the platform does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def settle_options(
    cfg, topo, target: Target, model, strategy: Strategy, micro: int, accumulation: int
) -> Decision[dict[str, Any]]:
    """The chosen strategy's options that depend on the batch layout (``Strategy.settle_options``), explicit."""
    job = None
    if model is not None:
        try:
            job = sizing_job(cfg, model, target, micro)
        except LadleError:
            job = None  # choose_strategy already warned that memory was not sized
    capacity = device_bytes(topo, target.device, target.processes_per_machine)
    lora = cfg.training.lora.enabled
    updates, reasons = strategy.settle_options(job, strategy.options(cfg), capacity, lora, accumulation)
    return Decision(updates, reasons)


def check_memory(cfg, topo, target: Target, model, strategy: Strategy, micro: int) -> Decision[dict[str, int]]:
    """The whole pipeline's memory for the chosen layout: loading and a training step per rank, the LoRA merge
    in host RAM, and one serving replica per device; a merge or a server that cannot fit this machine is
    refused now, not hours later."""
    if model is None:
        return Decision({})
    try:
        job = sizing_job(cfg, model, target, micro)
    except LadleError:
        return Decision({})  # choose_strategy already warned that memory was not sized
    est = strategy.estimate(job, strategy.options(cfg))
    stored = 4 if target.device == "cpu" or target.dtype == "float32" else 2  # the merged weights' dtype
    merge = sizing.merge_bytes(job.shape, stored) if cfg.training.lora.enabled else 0
    serve_cfg = cfg.serve
    device = device_bytes(topo, target.device, 1)
    gpus = topo.gpu_count if target.device == "cuda" else 0
    weights = job.shape.params * stored
    # Evaluate and the transformers backend: one GPU, or the layers spread over all (the loaders' own rule).
    spread = sizing.spread_over(weights, sizing.EVAL_LOGITS_BYTES, gpus, device)
    kv_tokens = cfg.serving().kv_cache_tokens
    tokens = kv_tokens // serve_cfg.max_batch_size  # the sizing counts rows x columns; the budget is the product
    kv = sizing.serve_bytes(job.shape, stored, serve_cfg.max_batch_size, tokens) - weights
    shards = sizing.spread_over(weights, kv, gpus, device)
    if backends.get(serve_cfg.backend).shards_model and target.device == "cuda":
        shards = serve_cfg.tensor_parallel or max(topo.gpu_count, 1)
    serve = sizing.serve_bytes(job.shape, stored, serve_cfg.max_batch_size, tokens, shards)
    evaluate = sizing.eval_bytes(job.shape, stored, cfg.data.seq_len, spread)
    context = sizing.CONTEXT_BYTES if target.device == "cuda" else 0
    serve, evaluate = serve + context, evaluate + context
    memory = {"load": est.load + est.context, "train": est.total, "merge": merge, "evaluate": evaluate, "serve": serve}
    if est.rollout:
        memory["rollouts"] = est.sampling
    if est.save:  # a CPU run: rank 0 holds the gathered outputs beside its states
        memory["save"] = est.states + est.save + est.context
    # The merge runs on this host; a recorded topology describes another one, whose RAM is not known.
    host = None if topo.source.startswith("file:") else host_bytes()
    reasons = [
        f"memory per rank: loading {sizing.gib(memory['load'])} (its share of the weights, read one tensor at a "
        f"time), training step {sizing.gib(est.total)}"
        + (
            f", rollouts {sizing.gib(est.sampling)} (the states, the KV cache and logits of sampling)"
            if est.rollout
            else ""
        )
        + (f", saving {sizing.gib(memory['save'])} (rank 0 gathers the outputs whole)" if est.save else "")
    ]
    problems, warnings = [], []
    if merge:
        reasons.append(f"merge: {sizing.gib(merge)} of host RAM (streamed one base shard at a time)")
        if host and merge > sizing.HEADROOM * host:
            problems.append(
                f"training.lora.enabled = true: merging the adapter needs {sizing.gib(merge)} of host RAM (one "
                f"{sizing.gib(min(job.shape.params * stored, sizing.MERGE_SHARD_BYTES))} base shard and the tensor "
                f"being folded) and this host has {sizing.gib(host)}. Save the base in smaller safetensors shards "
                "(save_pretrained(max_shard_size='2GB')) or run on a host with more memory."
            )
    spreading = f"its layers spread over {spread} GPUs (device_map=auto)" if spread > 1 else "one device"
    reasons.append(
        f"evaluate: {sizing.gib(evaluate)} per device over {spreading}: the merged weights, and the logits of an "
        "eval batch"
    )
    if device and evaluate > sizing.HEADROOM * device:
        warnings.append(
            f"evaluate: the merged model needs {sizing.gib(evaluate)} per device over {spreading} and each has "
            f"{sizing.gib(device)}. Evaluate on a host with more GPU memory, or lower training.eval_micro_batch_size."
        )
    where = f"{shards} device(s)" if shards > 1 else "one device"
    reasons.append(
        f"serve ({serve_cfg.backend}): {sizing.gib(serve)} per device over {where} (weights, and a KV cache of "
        f"{kv_tokens} tokens: serve.kv_cache_tokens, {serve_cfg.max_batch_size} request(s) x {tokens}; a prefill of "
        f"that many prompt tokens at once, {sizing.gib(sizing.prefill_bytes(job.shape, stored, kv_tokens))})"
    )
    if device and serve > sizing.HEADROOM * device:
        # A warning, not a refusal: the served model often runs elsewhere (another machine, or MII over more
        # GPUs than trained); the plan says so before any training starts.
        warnings.append(
            f"serve.backend = {serve_cfg.backend}: serving the merged model needs {sizing.gib(serve)} per device over "
            f"{where} and each has {sizing.gib(device)}. Shard it (serve.backend=mii with serve.tensor_parallel=0: "
            "every GPU), or lower serve.kv_cache_tokens (serve.max_batch_size / serve.max_new_tokens)."
        )
    return Decision(memory, tuple(reasons), tuple(warnings), tuple(problems))


def plan_estimate(cfg: LadleConfig, plan: Plan, model: dict) -> sizing.Estimate:
    """The memory model's per-rank figures for a made plan: its strategy and options, layout, micro-batch and
    dtype (what bench/memory.py and the memory test set beside measured memory)."""
    strategy = strategies.get(plan.strategy)
    target = Target(plan.device, plan.processes_per_machine, plan.num_machines, plan.dtype)
    cfg = with_training(cfg, gradient_checkpointing=plan.gradient_checkpointing)
    cfg = strategy.with_options(cfg, plan.strategy_options)  # as the plan settled them (``settle_options``)
    cfg = with_merged_rollouts(cfg, plan.merged_rollouts)
    return strategy.estimate(sizing_job(cfg, model, target, plan.micro_batch_size), strategy.options(cfg))


def device_bytes(topo: Topology, device: str, per_machine: int) -> int | None:
    """Memory one rank may use: its GPU's (the smallest visible), or on CPU the host's RAM shared by the processes."""
    if device == "cuda":
        sizes = [g.memory_mib for g in topo.gpus if g.memory_mib]
        return min(sizes) * 2**20 if sizes else None
    host = host_bytes()
    return host // per_machine if host else None


def sizing_job(cfg: LadleConfig, model: dict, target: Target, micro: int) -> sizing.Job:
    """What the memory model sizes: the base's shape, what is trained, and the batch on ``target``.

    Raises:
        LadleError: the model's config.json lacks what sizing needs.
    """
    from ladle.sizing import params
    from ladle.strategies.attention import unsupported

    lora = cfg.training.lora
    saved, kernels_cfg = lora.modules_to_save, cfg.training.kernels
    trainable = params.lora_params(model, lora.r, lora.target_modules, saved) if lora.enabled else None
    world = target.world_size
    return sizing.Job(
        shape=sizing.shape_from_config(model, trainable),
        lora=lora.enabled,
        qlora=cfg.training.quantization.mode != "none",
        micro_batch=micro,
        # a preference pair's row holds both sides: 2 x seq_len tokens through every layer and the head
        # grpo: a completion's row is its prompt (up to seq_len) and up to max_completion_tokens sampled after it
        seq_len=row_tokens(cfg),
        dtype_bytes=4 if target.dtype == "float32" else 2,
        checkpointing=cfg.training.gradient_checkpointing is True,  # auto: resolved by the plan before sizing
        gpus_per_node=target.processes_per_machine,
        nodes=target.nodes,
        microbatches=max(1, (cfg.training.global_batch_size or micro * world) // micro),
        cuda=target.device == "cuda",
        save_shard_bytes=cfg.training.save_shard_mib * 2**20,
        trained_ends=lora.enabled and params.trains_ends(model, saved),
        loss_chunk_bytes=0 if kernels_cfg.fused_loss == "off" else kernels_cfg.loss_chunk_mib * 2**20,
        liger_loss=kernels.liger_loss_expected(kernels_cfg, target.device),
        compiled=kernels.compile_expected(kernels_cfg, target.device),
        attention=unsupported(model),
        **rollout_sizes(cfg, model, target, micro),
        **grpo_rows(cfg, micro),
        masked=kernels.mask_expected(kernels_cfg, target.device, unsupported(model)),
    )


def rollout_parts(cfg: LadleConfig, model: dict, target: Target, local: int) -> dict[str, int]:
    """grpo: what ``local`` completions of one rank hold while they are sampled, in bytes: the KV cache at full
    width (a prompt of up to seq_len and every sampled token, keys and values of every layer, with one layer's
    copy as the cache grows), the batch's next-token logits with what drawing from them holds, and the
    log-probability buffers of the sampled tokens."""
    from ladle.sizing import params

    t = cfg.training
    width = cfg.data.seq_len + t.rl.completion_budget
    layers = int(model.get("num_hidden_layers") or 0)
    heads = int(model.get("num_key_value_heads") or model.get("num_attention_heads") or 0)
    head_dim = int(
        model.get("head_dim") or (model.get("hidden_size", 0) // max(1, model.get("num_attention_heads", 1)))
    )
    width_bytes = 4 if target.dtype == "float32" else 2
    merged = 0
    if t.lora.enabled and t.rl.merge_for_rollouts:  # resolved by the plan (``choose_merged_rollouts``)
        merged = (params.lora_base_params(model, t.lora.target_modules) or 0) * width_bytes
    return {
        "merged": merged,
        "kv": local * width * 2 * heads * head_dim * width_bytes * (layers + 1),
        # the logits, scaled by the temperature, their log-softmax and probabilities (float32) and running sums
        # (float64) that the draw reads (``ladle.serve.engine.plain_rollouts``)
        "logits": local * int(model.get("vocab_size") or 0) * (4 * 4 + 8),
        "buffers": local * t.rl.completion_budget * 4 * (1 + (t.rl.num_iterations > 1) + (t.rl.beta > 0)),
    }


def rollout_sizes(cfg: LadleConfig, model: dict, target: Target, micro: int) -> dict[str, int]:
    """grpo: what a rank's rollouts hold beside the states (``rollout_parts``), and of it the merged copy of the
    adapted weights, as ``sizing.Job`` fields; none for other objectives."""
    t = cfg.training
    if t.objective != "grpo":
        return {}
    world = max(target.world_size, 1)
    local = max(1, (t.global_batch_size or micro * world) // world)
    parts = rollout_parts(cfg, model, target, local)
    return {"rollout_bytes": sum(parts.values()), "rollout_merged": parts["merged"]}


def grpo_rows(cfg: LadleConfig, micro: int) -> dict[str, int]:
    """grpo: the completion part of a row, the prompts a micro-batch of ``micro`` completions runs once
    (``ladle.train.grpo.completion_logps``: groups of ``num_generations`` in a row, one more where a micro-batch
    does not start on a group's first; none with activation checkpointing, whose layers take no cache), and
    whether a frozen copy of the starting weights is held (a full fine-tune's KL reference)."""
    t = cfg.training
    if t.objective != "grpo":
        return {}
    group = max(t.rl.num_generations, 1)
    shared = 0 if t.gradient_checkpointing is True else min(micro, -(-micro // group) + (micro % group != 0))
    return {
        "completion_tokens": t.rl.completion_budget,
        "shared_prompts": shared,
        "frozen_reference": not t.lora.enabled and t.rl.beta > 0,
    }


def row_tokens(cfg: LadleConfig) -> int:
    """Tokens of one training row through every layer: seq_len; a preference pair's two sides; a prompt and
    its completion."""
    t = cfg.training
    if t.objective in ("dpo", "kto"):  # two sides: a pair's, or a judged answer's and its KL side's
        return 2 * cfg.data.seq_len
    if t.objective == "grpo":
        return cfg.data.seq_len + t.rl.completion_budget
    return cfg.data.seq_len


def size_candidates(cfg: LadleConfig, job: sizing.Job, interconnect: str, capacity: int) -> list[Sized]:
    """Every registered strategy's candidates for ``job``, fastest first, each sized with its options."""
    ranked = sorted(
        (c for s in strategies.REGISTRY.values() for c in s.candidates(job, interconnect, cfg)), key=lambda c: c.rank
    )
    out = []
    for candidate in ranked:
        if candidate.needs_cuda and not job.cuda:
            continue
        strategy = candidate.strategy
        options = strategy.options(strategy.with_options(cfg, candidate.options))
        if cfg.training.objective in ("dpo", "kto") and strategy.pairs_refusal(options):
            continue  # pairs train only where the whole forward runs on whole rows
        if cfg.training.objective == "grpo" and strategy.rollouts_refusal(options):
            continue  # rollouts sample where every rank holds whole weights
        est = strategy.estimate(job, options)
        out.append(Sized(candidate, est, est.fits(capacity)))
    return out


def choose_strategy(cfg: LadleConfig, topo: Topology, target: Target, model: dict | None) -> Decision[Chosen]:
    """The explicit strategy, or the fastest candidate that fits with headroom (every candidate recorded),
    with the option values that candidate sets."""
    explicit = cfg.parallelism.strategy
    overrides = (f"parallelism.strategy = {explicit} (explicit)",) if explicit != "auto" else ()
    implied = next((s for s in strategies.REGISTRY.values() if s.asked_for(cfg)), None)
    if explicit == "auto" and implied is not None:  # e.g. degrees set in parallelism.dims: they are the layout
        explicit = implied.name
        overrides = (f"parallelism.{implied.options_section} set: strategy {implied.name} runs what it asks for",)
    fallback = Chosen(strategies.default() if explicit == "auto" else strategies.get(explicit), {})
    capacity = device_bytes(topo, target.device, target.processes_per_machine)
    if model is None or capacity is None:
        if model is None:
            missing = "model size unknown (no config.json at hand: a local base folder, or --model-config)"
        else:
            missing = "device memory unknown (pass --gpu-memory with --topology-file)"
        why = f"strategy {fallback.strategy.name}: {missing}, so the default with the least communication"
        return Decision(fallback, (why,) if explicit == "auto" else (), overrides=overrides)
    try:
        micro = 1 if cfg.training.micro_batch_size == "auto" else cfg.training.micro_batch_size
        job = sizing_job(cfg, model, target, micro)
    except LadleError as err:
        return Decision(fallback, warnings=(f"memory not sized: {err}",), overrides=overrides)
    sized = size_candidates(cfg, job, topo.interconnect, capacity)
    first = next((s for s in sized if s.fits), None)
    limit = f"{sizing.usable(capacity)} of {sizing.gib(capacity)} per rank"
    if explicit != "auto":
        return explicit_strategy(cfg, job, fallback.strategy, sized, first, capacity, limit, overrides)
    rows = tuple(s.row() for s in sized)
    if first is None:
        smallest = min(rows, key=lambda r: r["per_rank_gib"])
        problem = (
            f"parallelism.strategy = auto: no strategy fits {limit}; the smallest is {smallest['strategy']} at "
            f"{smallest['breakdown']}. Train fewer weights (training.lora.enabled=true, or QLoRA with "
            f"training.quantization.mode=nf4), {recompute_hint(cfg)}lower training.micro_batch_size or "
            "data.seq_len, or add GPUs/nodes."
        )
        return Decision(Chosen(fallback.strategy, {}, rows), problems=(problem,))
    slower = [s.estimate.strategy for s in sized[: sized.index(first)]]
    skipped = f"; faster {', '.join(slower)} do not fit" if slower else ""
    est, candidate = first.estimate, first.candidate
    reasons = (f"strategy {est.strategy}: {candidate.why}; needs {est.summary()}, within {limit}{skipped}",)
    reasons += (candidate.reason,) if candidate.reason else ()
    whole = [s for s in sized if not s.candidate.splits_sequence]
    if candidate.splits_sequence and whole:
        least = min(whole, key=lambda s: s.estimate.total)
        reasons += (
            f"sequence parallelism: with whole sequences on each rank the smallest layout, {least.estimate.strategy}, "
            f"needs {least.estimate.summary()}, more than {limit}",
        )
    warnings = (candidate.warning,) if candidate.warning else ()
    return Decision(Chosen(candidate.strategy, candidate.options, rows), reasons, warnings)


def recompute_hint(cfg: LadleConfig) -> str:
    """The checkpointing fix, unless activations are already recomputed (auto turned it on, or it was asked)."""
    return "" if cfg.training.gradient_checkpointing else "set training.gradient_checkpointing=true, "


def explicit_strategy(cfg, job, strategy, sized, first, capacity, limit, overrides) -> Decision[Chosen]:
    """The named strategy with its configured options, sized; a warning when it does not fit."""
    est = strategy.estimate(job, strategy.options(cfg))
    rows = [s.row() for s in sized]
    same = next((s for s in sized if s.estimate == est and s.candidate.strategy is strategy), None)
    mine = same.row() if same else Sized(Candidate(strategy, -1, "explicit"), est, est.fits(capacity)).row()
    if same is None:
        rows.insert(0, mine)
    chosen = Chosen(strategy, {}, tuple(rows))
    if not mine["fits"]:
        better = f"; {first.candidate.strategy.name} would fit ({first.estimate.summary()})" if first else ""
        warning = f"parallelism.strategy = {strategy.name} needs {mine['breakdown']}, more than {limit}{better}"
        return Decision(chosen, warnings=(warning,), overrides=overrides)
    reason = f"strategy {strategy.name} (explicit): needs {mine['breakdown']}, within {limit}"
    return Decision(chosen, (reason,), overrides=overrides)


MICRO_CHOICES = (64, 32, 16, 8, 4, 2, 1)


def choose_micro(cfg, topo, target: Target, model, strategy: Strategy, replicas: int) -> Decision[int]:
    """``training.micro_batch_size``, or for ``auto`` the largest that fits the chosen strategy and divides the batch."""
    asked = cfg.training.micro_batch_size
    if asked != "auto":
        return Decision(asked)
    capacity = device_bytes(topo, target.device, target.processes_per_machine)
    wanted = cfg.training.global_batch_size
    if model is None or capacity is None:
        return Decision(1, ("micro-batch 1: auto, but the model size or device memory is unknown",))
    options = strategy.options(cfg)
    for micro in MICRO_CHOICES:
        if wanted and wanted % (micro * replicas):
            continue
        est = strategy.estimate(sizing_job(cfg, model, target, micro), options)
        if est.fits(capacity):
            divides = f" and divides the global batch {wanted}" if wanted else ""
            choices = "/".join(map(str, MICRO_CHOICES))
            return Decision(
                micro, (f"micro-batch {micro}: the largest of {choices} that fits ({est.summary()}){divides}",)
            )
    return Decision(
        1, warnings=("micro-batch 1: auto found no micro-batch that fits; even 1 row per process exceeds the device",)
    )
