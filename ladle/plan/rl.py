"""The plan's decisions for online RL (``training.objective: grpo``): whether the strategy can sample rollouts,
whether the step's completions make whole groups on every rank, and what the rollouts hold in memory, in GiB."""

from __future__ import annotations

from ladle import sizing
from ladle.config import LadleConfig
from ladle.plan.model import Decision
from ladle.strategies import Strategy
from ladle.strategies.base import Target


def choose_rollouts(
    cfg: LadleConfig, strategy: Strategy, target: Target, model: dict | None, micro: int, global_batch: int
) -> Decision[None]:
    """The rollouts' layout and memory, in words, with every problem that stops them."""
    t = cfg.training
    if t.objective != "grpo":
        return Decision(None)
    rl, problems = t.rl, []
    why_not = strategy.rollouts_refusal(strategy.options(cfg))
    if why_not:
        problems.append(
            f"training.objective = grpo with parallelism.strategy = {strategy.name}: {why_not}. Use ddp, zero1, "
            "zero2, zero3 or fsdp2 without offload (or parallelism.strategy=auto)."
        )
    world = target.world_size
    if global_batch % rl.num_generations:
        problems.append(
            f"training.global_batch_size = {global_batch}: with grpo it counts completions and must be a multiple "
            f"of training.rl.num_generations = {rl.num_generations}; set it to "
            f"{max(1, global_batch // rl.num_generations) * rl.num_generations} or "
            f"{(global_batch // rl.num_generations + 1) * rl.num_generations}"
        )
    local = global_batch // max(world, 1)
    reasons = [
        f"rollouts: {global_batch // max(rl.num_generations, 1)} prompt(s) x {rl.num_generations} completions per "
        f"step, {local} sampled on each of {world} rank(s) by ladle's engine on the live weights (no copy, no "
        f"reload); updates {micro} completion(s) per micro-batch, {rl.num_iterations} optimizer step(s) per batch"
    ]
    if cfg.eval.probe and rl.probe_every:
        guard = (
            f"a fall of more than promote.max_probe_drop = {cfg.promote.max_probe_drop} ends the run with the "
            "adapter of the last check within it"
            if rl.probe_guard == "restore" and cfg.promote.max_probe_drop is not None
            else "reported"
        )
        reasons.append(
            f"probe: {cfg.eval.probe} asked of the live policy every {rl.probe_every} step(s) and at the end; "
            f"{guard} (grpo watches ladle://general-probe unless eval.probe is set; eval.probe=null: off)"
        )
    if model is not None:
        reasons.append(rollout_memory(cfg, target, model, local, micro))
        if strategy.shards_tensors and not why_not:
            reasons.append(gathered_weights(strategy.name, target, model))
        if rl.beta and not t.lora.enabled:
            reasons.append(reference_weights(strategy.name, strategy.shards_tensors, target, model))
    return Decision(None, tuple(reasons), problems=tuple(problems))


def choose_merged_rollouts(
    cfg: LadleConfig, topo, target: Target, model: dict | None, strategy: Strategy, micro: int
) -> Decision[bool]:
    """``training.rl.merge_for_rollouts`` resolved: LoRA's rollouts sample with each adapted layer's weight and
    adapter summed into one matrix where the plan fits with that copy (null), or as asked; why, in GiB."""
    from ladle.errors import LadleError
    from ladle.plan.memory import device_bytes, sizing_job, with_merged_rollouts
    from ladle.sizing import params

    t = cfg.training
    asked = t.rl.merge_for_rollouts
    if t.objective != "grpo":
        return Decision(False)
    if not t.lora.enabled:
        problems = ()
        if asked:
            problems = (
                "training.rl.merge_for_rollouts = true: a full fine-tune samples with its own weights and has no "
                "adapter to merge. Remove it, or set training.lora.enabled=true.",
            )
        return Decision(False, problems=problems)
    if asked is False:
        return Decision(False, ("rollouts sample through the adapters (training.rl.merge_for_rollouts = false)",))
    copy = params.lora_base_params(model, t.lora.target_modules) if model is not None else None
    if copy is None:
        if asked:
            return Decision(
                True, ("rollouts: the adapters merged into a copy of the adapted weights (explicit; not sized)",)
            )
        return Decision(
            False,
            ("rollouts sample through the adapters: the adapted weights' size is unknown, so no merged copy is made "
             "(training.rl.merge_for_rollouts=true makes one)",),
        )  # fmt: skip
    width = 4 if target.dtype == "float32" else 2
    what = f"a copy of the adapted weights with their adapters merged, {sizing.gib(copy * width)} per rank"
    if asked:
        return Decision(
            True, (f"rollouts sample with {what} (explicit), made at each step's rollouts and freed after",)
        )
    merged = with_merged_rollouts(cfg, True)
    capacity = device_bytes(topo, target.device, target.processes_per_machine)
    try:
        est = strategy.estimate(sizing_job(merged, model, target, micro), strategy.options(merged))
    except LadleError:
        est = None
    if est is None or capacity is None:
        return Decision(False, (f"rollouts sample through the adapters: memory not sized, so no copy ({what})",))
    need, limit = sizing.gib(max(est.total, est.sampling)), f"{sizing.usable(capacity)} a rank"
    if est.fits(capacity):
        return Decision(
            True,
            (f"rollouts sample with {what}, made at each step's rollouts and freed after (auto: the plan needs "
             f"{need} with it, within {limit})",),
        )  # fmt: skip
    return Decision(
        False,
        (f"rollouts sample through the adapters (auto): with {what}, the plan would need {need}, more than "
         f"{limit}",),
    )  # fmt: skip


def weights_bytes(target: Target, model: dict) -> int | None:
    """Every weight of the base in the run's dtype, in bytes (None: its config.json lacks the shape)."""
    try:
        params = sizing.shape_from_config(model).params
    except (KeyError, TypeError, ValueError):
        return None
    return params * (4 if target.dtype == "float32" else 2)


def reference_weights(name: str, sharded: bool, target: Target, model: dict) -> str:
    """What a full fine-tune's KL reference (a frozen copy of the starting weights) holds per rank, in words."""
    whole = weights_bytes(target, model)
    if whole is None:
        return "KL reference: a frozen copy of the starting weights (not sized)"
    if sharded:
        world = max(target.world_size, 1)
        return (
            f"KL reference: a frozen copy of the starting weights, sharded by {name} as the trained ones are, "
            f"{sizing.gib(whole // world)} per rank ({sizing.gib(whole)} over {world} ranks)"
        )
    return f"KL reference: a frozen copy of the starting weights, whole on each rank, {sizing.gib(whole)} per rank"


def rollout_memory(cfg: LadleConfig, target: Target, model: dict, local: int, micro: int) -> str:
    """What the rollouts add per rank, in words: the KV cache of every completion at full length, the sampling
    logits and log-probability buffers (``ladle.plan.memory.rollout_parts``, which the fit check counts), and one
    update micro-batch's float32 logits of the completions."""
    from ladle.plan.memory import rollout_parts

    rl = cfg.training.rl
    try:
        shape = sizing.shape_from_config(model)
    except (KeyError, TypeError, ValueError):
        return "rollout memory: not sized (the base's config.json lacks the shape)"
    parts = rollout_parts(cfg, model, target, local)
    layers = int(model.get("num_hidden_layers") or 0)
    logits = micro * (rl.completion_budget + 1) * shape.vocab * 4 * 2  # the logits and their log-softmax
    return (
        f"rollout memory per rank: KV cache {sizing.gib(parts['kv'])} ({local} completions x "
        f"{cfg.data.seq_len + rl.completion_budget} tokens x {layers} layers), sampling logits "
        f"{sizing.gib(parts['logits'])}, log-probability buffers {sizing.gib(parts['buffers'])}; completion logits "
        f"{sizing.gib(logits)} per update micro-batch"
    )


def gathered_weights(name: str, target: Target, model: dict) -> str:
    """What gathering every weight for the rollouts holds per rank (ZeRO-3, FSDP2), in words."""
    whole = weights_bytes(target, model)
    if whole is None:
        return f"rollout weights: {name} gathers every weight whole on each rank while it samples (not sized)"
    return (
        f"rollout weights: {name} gathers every weight whole on each rank while it samples, "
        f"{sizing.gib(whole)} per rank for the step's rollouts (partitioned again for the update)"
    )
