"""Validate the config against the machine and decide how to train.

Every problem is collected and reported in one error before any process starts.
The plan carries its reasons: each derived value says where it came from, and
each explicit setting that won over a derived one is listed as an override.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from ladle import cuda_arch, sizing, strategies
from ladle.config import LadleConfig
from ladle.errors import ConfigError, LadleError
from ladle.plan_model import DEFAULT_PORT, Plan
from ladle.serve import backends
from ladle.serve.backends import Backend
from ladle.strategies import Candidate, Strategy, Target
from ladle.topology import Topology
from ladle.train import kernels

__all__ = ["DEFAULT_PORT", "Plan", "make_plan"]

T = TypeVar("T")


@dataclass(frozen=True)
class Decision(Generic[T]):
    """One planning step's result: its value, why, and what it warns about, refuses or lets win."""

    value: T
    reasons: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    problems: tuple[str, ...] = ()
    overrides: tuple[str, ...] = ()


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


def make_plan(cfg: LadleConfig, topo: Topology, config_ref: str = "CONFIG", model: dict | None = None) -> Plan:
    """Decide world size, strategy, batch layout and dtype for ``cfg`` on ``topo``.

    ``model`` is the base's ``config.json``; with it the strategy is sized by the memory model
    (each strategy's ``estimate``), without it ``auto`` means the default strategy and the plan
    says the size was unknown.

    Raises:
        ConfigError: every problem found, each with its field, value and fix.
    """
    world = choose_world(cfg, topo, config_ref)
    device, asked = world.value
    nodes = choose_nodes(cfg, topo)
    dtype = choose_dtype(cfg, topo, device)
    recompute = choose_checkpointing(cfg, topo, Target(device, asked, nodes.value, dtype.value), model)
    cfg = with_training(cfg, gradient_checkpointing=recompute.value)  # a copy with auto resolved
    chosen = choose_strategy(cfg, topo, Target(device, asked, nodes.value, dtype.value), model)
    strategy = chosen.value.strategy
    cfg = strategy.with_options(cfg, chosen.value.updates)  # a copy: the caller's config is left as it was
    options = strategy.options(cfg)
    per_machine, adapted = strategy.processes(cfg, device, asked)
    layout = Decision(per_machine, (adapted,) if adapted else ())
    target = Target(device, per_machine, nodes.value, dtype.value)
    replicas = strategy.data_parallel_degree(target.world_size, options)
    micro = choose_micro(cfg, topo, target, model, strategy, replicas)
    batch = choose_batch(cfg, micro.value, replicas, strategy.default_accumulation(options))
    accumulation, global_batch = batch.value
    checks = Decision(
        None,
        problems=(
            *check_strategy(cfg, topo, target, model, strategy, micro.value, accumulation, global_batch),
            *check_features(cfg, device, strategy, live=not topo.source.startswith("file:")),
        ),
    )
    memory = check_memory(cfg, topo, target, model, strategy, micro.value)
    eval_micro = choose_eval_micro(cfg, target, model, strategy, micro.value)
    serving = check_serving(cfg, model, target)
    steps = (world, nodes, recompute, chosen, layout, micro, batch, dtype, checks, memory, eval_micro, serving)
    shape = shape_summary(model)
    plan = build_plan(
        cfg, topo, strategy, target, micro.value, batch.value, steps, list(chosen.value.candidates), shape
    )
    plan.memory = memory.value
    plan.eval_micro_batch_size = eval_micro.value
    plan.gradient_checkpointing = recompute.value
    return plan


def with_training(cfg: LadleConfig, **updates: Any) -> LadleConfig:
    """A copy of ``cfg`` with ``training`` fields replaced (the caller's config is left as it was)."""
    return cfg.model_copy(update={"training": cfg.training.model_copy(update=updates)})


def choose_checkpointing(cfg: LadleConfig, topo: Topology, target: Target, model: dict | None) -> Decision[bool]:
    """``training.gradient_checkpointing``, or for ``auto``: off when some strategy (the named one, if named)
    fits the device without it; on when only recomputing activations makes one fit, and when nothing fits
    either way (the strategy step then says what else to change)."""
    asked = cfg.training.gradient_checkpointing
    if asked != "auto":
        return Decision(bool(asked))
    capacity = device_bytes(topo, target.device, target.processes_per_machine)
    if model is None or capacity is None:
        return Decision(False, ("activation checkpointing off (auto): the model size or device memory is unknown",))
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
            fitting[recompute] = next((s for s in sized if s.fits), None), min(sized, key=lambda s: s.estimate.total)
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
    # Nothing fits either way: recompute (the closer to fitting), so the strategy step sizes and reports that.
    return Decision(True, ("activation checkpointing on (auto): nothing fits without it, nor with it",))


def check_serving(cfg: LadleConfig, model: dict | None, target: Target) -> Decision[None]:
    """Whether ``serve.backend`` can serve what this run will produce (the base's architecture, in the run's
    dtype), decided before anything trains; and, on a GPU, the arch list DeepSpeed's op builds will get."""
    reasons, warnings = [], []
    backend = backends.get(cfg.serve.backend)
    if backend.requires_cuda and target.device != "cuda":
        return Decision(None)  # check_features says it cannot run here at all; its fix makes these moot
    problems = backend.model_problems(model, target.dtype) if model is not None else []
    if model is None and backend.model_problems.__func__ is not Backend.model_problems.__func__:
        warnings.append(
            f"serve.backend = {backend.name}: the base's config.json was not read, so whether {backend.title} can "
            "serve the model is checked only when the server starts."
        )
    if target.device == "cuda":
        _, changed = cuda_arch.fixed_env()
        reasons += [changed] if changed else []
    return Decision(None, tuple(reasons), tuple(warnings), tuple(problems))


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


def build_plan(
    cfg: LadleConfig,
    topo: Topology,
    strategy: Strategy,
    target: Target,
    micro: int,
    batch: tuple[int, int],
    steps: tuple[Decision, ...],
    candidates: list[dict],
    model_shape: dict[str, int] | None = None,
) -> Plan:
    """The plan from the decisions' values and reasons, with the strategy's launcher config.

    Raises:
        ConfigError: every problem any decision found, with what was decided so far in its details.
    """
    reasons = [r for step in steps for r in step.reasons]
    warnings = [*topo.warnings, *(w for step in steps for w in step.warnings)]
    problems = [p for step in steps for p in step.problems]
    device, (accumulation, global_batch) = target.device, batch
    options = strategy.options(cfg)
    if problems:
        # What was decided so far travels with the error: `ladle plan --json` shows why nothing fits.
        raise ConfigError(
            problems,
            details={
                "device": device,
                "world_size": target.world_size,
                "dtype": target.dtype,
                "reasons": reasons,
                "warnings": warnings,
                "candidates": candidates,
            },
        )
    plan = Plan(
        strategy=strategy.name,
        strategy_options=options.model_dump() if options is not None else {},
        device=device,
        backend="nccl" if device == "cuda" else "gloo",
        world_size=target.world_size,
        num_machines=target.nodes,
        processes_per_machine=target.processes_per_machine,
        main_address=cfg.parallelism.main_address,
        main_port=cfg.parallelism.main_port,
        micro_batch_size=micro,
        gradient_accumulation=accumulation,
        global_batch_size=global_batch,
        dtype=target.dtype,
        reasons=reasons,
        overrides=[o for step in steps for o in step.overrides],
        warnings=warnings,
        candidates=candidates,
        model_shape=model_shape,
        mesh=strategy.dims(options, target.world_size, target.nodes).degrees(),
    )
    plan.kernels, why = kernels.decide(
        cfg.training.kernels,
        strategy.name,
        device,
        target.dtype,
        fsdp2_compile=cfg.parallelism.fsdp2.compile,
    )
    plan.reasons += why
    plan.launcher_config, resolved = strategy.configure(cfg, plan)
    plan.reasons += resolved
    return plan


def host_bytes() -> int | None:
    """This machine's physical memory (None when the platform does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


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
    if est.save:  # a CPU run: rank 0 holds the gathered outputs beside its states
        memory["save"] = est.states + est.save + est.context
    # The merge runs on this host; a recorded topology describes another one, whose RAM is not known.
    host = None if topo.source.startswith("file:") else host_bytes()
    reasons = [
        f"memory per rank: loading {sizing.gib(memory['load'])} (its share of the weights, read one tensor at a "
        f"time), training step {sizing.gib(est.total)}"
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
        f"{kv_tokens} tokens: serve.kv_cache_tokens, {serve_cfg.max_batch_size} request(s) x {tokens})"
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
    return strategy.estimate(sizing_job(cfg, model, target, plan.micro_batch_size), strategy.options(cfg))


def shape_summary(model: dict | None) -> dict[str, int] | None:
    """The sizes launcher configs are derived from (e.g. DeepSpeed's bucket sizes), or None when unknown."""
    if model is None:
        return None
    try:
        shape = sizing.shape_from_config(model)
    except (KeyError, TypeError, ValueError, LadleError):
        return None
    return {
        "hidden_size": shape.hidden,
        "layer_params": shape.layer_params,
        "largest_tensor": shape.largest_tensor,
        "params": shape.params,
    }


def choose_nodes(cfg: LadleConfig, topo: Topology) -> Decision[int]:
    """Machines taking part: the config's ``parallelism.nodes``, else the launcher environment's; and whether
    the compute target can run them."""
    from ladle.compute.requirements import problems as target_problems
    from ladle.compute.requirements import rendezvous

    target = cfg.compute.target
    if target != "local":  # the scheduler places the nodes and the rendezvous
        nodes = cfg.parallelism.nodes
        reason = f"{nodes} node(s) from compute target {target}; rendezvous on {rendezvous(cfg)}"
        live = not topo.source.startswith("file:")
        return Decision(nodes, (reason,), problems=tuple(target_problems(cfg, live)))
    nodes = cfg.parallelism.nodes if cfg.parallelism.nodes > 1 else topo.nodes
    if nodes == 1:
        return Decision(1)
    address, port = cfg.parallelism.main_address, cfg.parallelism.main_port
    problems = ()
    if port == 0:
        problems = (
            f"parallelism.main_port = 0: a {nodes}-node run needs a fixed rendezvous port that every node "
            "can reach. Set parallelism.main_port (e.g. 29500) and parallelism.main_address.",
        )
    return Decision(nodes, (f"{nodes} nodes: rendezvous at {address}:{port}",), problems=problems)


def choose_world(cfg: LadleConfig, topo: Topology, config_ref: str) -> Decision[tuple[str, int]]:
    """Device and processes per machine."""
    gpus = cfg.parallelism.gpus
    if topo.gpu_count == 0:
        procs = cfg.parallelism.cpu_processes
        problems = ()
        if gpus != "auto":
            fixed = shlex.join(["ladle", "run", config_ref, "--gpus", "auto"])
            problems = (
                f"parallelism.gpus = {gpus}: this host has no CUDA GPU (nvidia-smi found none). "
                f"Run on a GPU host, or train on CPU with: {fixed}",
            )
        warning = (
            f"--gpus auto found no GPU: planning a CPU run of {procs} gloo process(es) (parallelism.cpu_processes)"
        )
        reason = f"{procs} process(es) per machine: CPU host, parallelism.cpu_processes={procs}"
        return Decision(("cpu", procs), (reason,), (warning,), problems)
    if gpus == "auto":
        reason = f"{topo.gpu_count} process(es) per machine: --gpus auto uses all {topo.gpu_count} visible GPU(s)"
        return Decision(("cuda", topo.gpu_count), (reason,))
    problems = ()
    if gpus > topo.gpu_count:
        fixed = shlex.join(["ladle", "run", config_ref, "--gpus", str(topo.gpu_count)])
        problems = (
            f"parallelism.gpus = {gpus}: this host has {topo.gpu_count} visible GPU(s). "
            f"Ask for at most {topo.gpu_count}, e.g.: {fixed} (or --gpus auto)",
        )
    reason = f"{gpus} process(es) per machine: --gpus {gpus} (of {topo.gpu_count} visible)"
    return Decision(("cuda", gpus), (reason,), problems=problems)


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
    from ladle import params

    lora = cfg.training.lora
    saved, kernels_cfg = lora.modules_to_save, cfg.training.kernels
    trainable = params.lora_params(model, lora.r, lora.target_modules, saved) if lora.enabled else None
    world = target.world_size
    return sizing.Job(
        shape=sizing.shape_from_config(model, trainable),
        lora=lora.enabled,
        qlora=cfg.training.quantization.mode != "none",
        micro_batch=micro,
        seq_len=cfg.data.seq_len,
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
    )


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
        est = strategy.estimate(job, strategy.options(strategy.with_options(cfg, candidate.options)))
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
    limit = f"{sizing.gib(sizing.HEADROOM * capacity)} usable of {sizing.gib(capacity)} per rank"
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


def choose_batch(
    cfg: LadleConfig, micro: int, replicas: int, default_accumulation: int = 1
) -> Decision[tuple[int, int]]:
    """Accumulation (pipeline: microbatches per step) and global batch for ``replicas`` data-parallel replicas."""
    per_step = micro * replicas
    wanted = cfg.training.global_batch_size or per_step * default_accumulation
    if wanted % per_step:
        lower, upper = max(per_step, wanted // per_step * per_step), (wanted // per_step + 1) * per_step
        problem = (
            f"training.global_batch_size = {wanted}: not a multiple of micro_batch_size x data-parallel ranks "
            f"({micro} x {replicas} = {per_step}). Use {lower} or {upper}."
        )
        return Decision((1, wanted), problems=(problem,))
    accum = wanted // per_step
    return Decision(
        (accum, wanted),
        (f"gradient accumulation {accum}: global batch {wanted} / ({micro} micro x {replicas} replica(s))",),
    )


def choose_dtype(cfg: LadleConfig, topo: Topology, device: str) -> Decision[str]:
    """``training.dtype``, or for ``auto`` float32 on CPU and the widest 16-bit type every GPU computes in."""
    asked = cfg.training.dtype
    if device == "cpu":
        problems = ()
        if asked == "float16":
            problems = ("training.dtype = float16: float16 training needs CUDA. Use float32 or bfloat16 on CPU.",)
        dtype = "float32" if asked == "auto" else asked
        return Decision(
            dtype, (f"dtype {dtype}: CPU run" + (" (auto)" if asked == "auto" else " (explicit)"),), problems=problems
        )
    if asked != "auto":
        return Decision(asked)
    caps = [float(g.compute_capability or 0) for g in topo.gpus]
    dtype = "bfloat16" if caps and min(caps) >= 8.0 else "float16"
    return Decision(
        dtype, (f"dtype {dtype}: lowest compute capability {min(caps) if caps else 'unknown'} (bf16 needs >= 8.0)",)
    )


def check_strategy(
    cfg, topo, target: Target, model, strategy: Strategy, micro: int, accumulation: int, global_batch: int
) -> list[str]:
    """The chosen strategy's own checks, and any other strategy's options that it would ignore."""
    problems = strategy.validate(cfg, topo, target)
    if model is not None:
        problems += strategy.validate_model(cfg, model, target.world_size)
    problems += strategy.validate_batch(strategy.options(cfg), micro, accumulation, global_batch)
    for other in strategies.REGISTRY.values():
        problems += other.validate_unused(cfg, strategy)
    problems += kernels.problems(cfg.training.kernels, strategy.name, target.device)
    return problems


def bitsandbytes_installed() -> bool:
    return importlib.util.find_spec("bitsandbytes") is not None


def check_features(cfg: LadleConfig, device: str, strategy: Strategy, live: bool = True) -> list[str]:
    """Features that need CUDA or a particular strategy, checked before anything starts; ``live``: the plan is
    for this host (not a recorded topology), so what is installed here matters."""
    problems = []
    quant = cfg.training.quantization
    if quant.mode != "none" and live and not bitsandbytes_installed():
        problems.append(
            f"training.quantization.mode = {quant.mode}: 4-bit QLoRA quantizes the base with bitsandbytes, which "
            "is not installed. Install it with: pip install 'ladle[qlora]' (or set training.quantization.mode=none)."
        )
    if device == "cpu" and quant.mode != "none":
        problems.append(
            f"training.quantization.mode = {quant.mode}: 4-bit QLoRA needs CUDA and "
            "bitsandbytes; this host has no GPU. Set training.quantization.mode=none or run on a GPU host."
        )
    problems += backends.get(cfg.serve.backend).host_problems(has_cuda=device == "cuda", installed_here=live)
    if cfg.output.startswith("memory://"):
        problems.append(
            f"output = {cfg.output}: training runs in separate processes, which cannot see this process's "
            "in-memory filesystem. Use a local folder or an object store URL (s3://...)."
        )
    if quant.mode != "none" and quant.storage_dtype == "uint8" and strategy.shards_tensors:
        # The planned strategy, not the config's field: `auto` may have chosen a sharded one.
        asked = cfg.parallelism.strategy
        named = strategy.name if asked == strategy.name else f"{asked} (planned: {strategy.name})"
        problems.append(
            f"training.quantization.storage_dtype = uint8 with parallelism.strategy = {named}: "
            "sharding needs the packed 4-bit weights in a float dtype. Set training.quantization.storage_dtype="
            "bfloat16 (or auto)."
        )
    if quant.mode != "none" and not cfg.training.lora.enabled:
        problems.append(
            f"training.quantization.mode = {quant.mode}: a 4-bit base cannot be trained "
            "directly. Set training.lora.enabled=true (QLoRA) or quantization.mode=none."
        )
    return problems
