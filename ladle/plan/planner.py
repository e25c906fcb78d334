"""Validate the config against the machine and decide how to train.

Every problem is collected and reported in one error before any process starts.
The plan carries its reasons: each derived value says where it came from, and
each explicit setting that won over a derived one is listed as an override.
"""

from __future__ import annotations

import importlib.util
import shlex

from ladle import sizing, strategies
from ladle.config import LadleConfig
from ladle.errors import ConfigError, LadleError
from ladle.machine import cuda_arch
from ladle.machine.topology import Topology
from ladle.plan import kernels
from ladle.plan.memory import (
    check_memory,
    choose_checkpointing,
    choose_eval_micro,
    choose_micro,
    choose_strategy,
    plan_estimate,
    settle_options,
    sizing_job,
    with_merged_rollouts,
    with_training,
)
from ladle.plan.model import DEFAULT_PORT, Decision, Plan
from ladle.plan.preference import choose_reference
from ladle.plan.rl import choose_merged_rollouts, choose_rollouts
from ladle.serve import backends
from ladle.serve.backends import Backend
from ladle.strategies import Strategy, Target

__all__ = ["DEFAULT_PORT", "Decision", "Plan", "make_plan", "plan_estimate", "sizing_job"]


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
    settled = settle_options(cfg, topo, target, model, strategy, micro.value, accumulation)
    cfg = strategy.with_options(cfg, settled.value) if settled.value else cfg
    merged = choose_merged_rollouts(cfg, topo, target, model, strategy, micro.value)
    if cfg.training.objective == "grpo":  # sized below with the copy, or without it
        cfg = with_merged_rollouts(cfg, merged.value)
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
    reference = choose_reference(cfg, strategy, target, model)
    rollouts = choose_rollouts(cfg, strategy, target, model, micro.value, global_batch)
    steps = (
        world, nodes, recompute, chosen, layout, micro, batch, settled, merged, dtype, checks, memory, eval_micro,
        serving, reference, rollouts,
    )  # fmt: skip
    shape = shape_summary(model)
    plan = build_plan(
        cfg, topo, strategy, target, micro.value, batch.value, steps, list(chosen.value.candidates), shape
    )
    plan.memory = memory.value
    plan.eval_micro_batch_size = eval_micro.value
    plan.gradient_checkpointing = recompute.value
    plan.reference = reference.value
    plan.merged_rollouts = merged.value
    return plan


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
        compile_asked=strategy.compile_asked(options),
        whole_forward=strategy.runs_whole_forward(options),
        rows="rollouts" if cfg.training.objective == "grpo" else "packed",
    )
    plan.reasons += why
    plan.launcher_config, resolved = strategy.configure(cfg, plan)
    plan.reasons += resolved
    return plan


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
    whole = strategy.runs_whole_forward(strategy.options(cfg))
    problems += kernels.problems(cfg.training.kernels, strategy.name, target.device, whole)
    if (
        cfg.training.objective == "grpo"
        and cfg.training.kernels.padding_free is True
        and cfg.training.gradient_checkpointing is True
    ):
        problems.append(
            "training.kernels.padding_free = true with training.gradient_checkpointing = true under grpo: the "
            "completions run as one row on their prompts' keys and values, which the update keeps only where the "
            "prompts run apart from their completions, and recomputed layers take no cache. Set "
            "training.kernels.padding_free=auto or training.gradient_checkpointing=false."
        )
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
