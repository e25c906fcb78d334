"""The DeepSpeed JSON the ZeRO strategies render from ladle's config (``ladle.strategies.deepspeed``), and its
check by DeepSpeed's own config model before launch. No DeepSpeed import until ``validate_with_deepspeed``, so
``ladle plan`` stays fast."""

from __future__ import annotations

from typing import Any

from ladle.strategies.deepspeed_import import import_deepspeed

NO_PRINT = 10**9

DEEPSPEED_DEFAULTS = {
    "reduce_bucket_size": 500_000_000,
    "stage3_prefetch_bucket_size": 50_000_000,
    "stage3_max_live_parameters": 1_000_000_000,
    "stage3_max_reuse_distance": 1_000_000_000,
    "sub_group_size": 1_000_000_000,
}
STAGE3_ONLY = {key for key in DEEPSPEED_DEFAULTS if key.startswith("stage3") or key == "sub_group_size"}


def resolve_buckets(opts: dict, shape: dict | None) -> tuple[dict[str, int], dict[str, str]]:
    """The bucket and liveness sizes, with ``auto`` resolved from the model's shape, and why.

    DeepSpeed's defaults are sized for no model in particular: a 5e8-element reduce bucket is 2 GB in
    float32, 1e9 live/reuse elements keep every layer of a sub-1B model gathered from its forward to its
    backward, so ZeRO-3 would hold as much as DDP, and a 1e9-element sub-group steps a rank's whole partition
    at once (a float32 copy of its gradients plus the optimizer's temporaries: measured, ZeRO-3's full
    fine-tune of a 0.38B model on 2 CPU ranks peaked 2 GB above its states). Sized from the model, a rank
    holds its shards plus about two layers.
    """
    values, reasons = {}, {}
    for key, default in DEEPSPEED_DEFAULTS.items():
        asked = opts.get(key, "auto")
        if asked != "auto":
            values[key] = int(asked)
            continue
        if shape is None:
            values[key] = default
            reasons[key] = f"deepspeed {key} {default:,}: auto, but the model size is unknown (DeepSpeed's default)"
            continue
        hidden, layer, largest = shape["hidden_size"], shape["layer_params"], shape["largest_tensor"]
        values[key], why = {
            "reduce_bucket_size": (hidden * hidden, "hidden^2"),
            "stage3_prefetch_bucket_size": (int(0.9 * hidden * hidden), "0.9 x hidden^2"),
            "stage3_max_live_parameters": (max(2 * layer, largest), "two decoder layers, or the largest tensor"),
            "stage3_max_reuse_distance": (layer, "one decoder layer"),
            "sub_group_size": (
                sub_group_elements("auto", layer, largest),
                "one decoder layer: the step's float32 gradient copy and "
                "optimizer temporaries are a layer's size, not the whole partition's",
            ),
        }[key]
        reasons[key] = f"deepspeed {key} {values[key]:,} (auto): {why}"
    return values, reasons


def sub_group_elements(asked: int | str, layer: int, largest: int) -> int:
    """``sub_group_size`` in elements: ``auto`` is one decoder layer, or the largest tensor if that is larger."""
    return int(asked) if asked != "auto" else max(layer, largest)


def offload(device: str, opts: dict) -> dict:
    target = {"device": device, "pin_memory": True}
    if device == "nvme":
        target["nvme_path"] = opts["nvme_path"]
    return target


def render_zero(stage: int, name: str, cfg, plan) -> tuple[dict, list[str]]:
    """ZeRO-``stage``'s DeepSpeed JSON for ``plan``, and why each chosen value is what it is."""
    opts = plan.strategy_options
    zero: dict[str, Any] = {
        "stage": stage,
        "overlap_comm": opts["overlap_comm"] and plan.device == "cuda",
        "contiguous_gradients": True,
        "reduce_scatter": True,
    }
    knobs, knob_reasons = resolve_buckets(opts, plan.model_shape)
    zero["reduce_bucket_size"] = zero["allgather_bucket_size"] = knobs["reduce_bucket_size"]
    if opts["offload_optimizer"] != "none":
        zero["offload_optimizer"] = offload(opts["offload_optimizer"], opts)
    if stage == 3:
        zero.pop("allgather_bucket_size")
        zero.update(
            {
                "stage3_prefetch_bucket_size": knobs["stage3_prefetch_bucket_size"],
                "stage3_max_live_parameters": knobs["stage3_max_live_parameters"],
                "stage3_max_reuse_distance": knobs["stage3_max_reuse_distance"],
                "sub_group_size": knobs["sub_group_size"],
                "stage3_gather_16bit_weights_on_model_save": True,
            }
        )
        if opts["offload_param"] != "none":
            zero["offload_param"] = offload(opts["offload_param"], opts)
    reasons = [r for key, r in knob_reasons.items() if stage == 3 or key not in STAGE3_ONLY]
    lora = cfg.training.lora
    if stage == 3 and lora.enabled and plan.world_size > 1:
        if not opts["shard_head"] or opts["offload_param"] != "none":
            why = "shard_head=false" if not opts["shard_head"] else "offload_param is on"
            reasons.append(f"{name} vocabulary: the embedding and the head are ZeRO-3 parameters ({why})")
        else:
            trained = f" unless modules_to_save {lora.modules_to_save} trains them" if lora.modules_to_save else ""
            reasons.append(
                f"{name} vocabulary: LoRA leaves the embedding and the head frozen, so each rank holds its "
                f"rows as a plain tensor and the lookup and loss run vocabulary-parallel: neither is gathered "
                f"whole{trained} (untied ends only; the run's sharding says which)"
            )
    if plan.device == "cpu" and opts["overlap_comm"]:
        reasons.append("deepspeed overlap_comm off: it overlaps on CUDA streams, which a CPU run lacks")
    config = {
        "train_batch_size": plan.global_batch_size,
        "train_micro_batch_size_per_gpu": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.gradient_accumulation,
        "gradient_clipping": float(cfg.training.max_grad_norm),
        "zero_optimization": zero,
        "bf16": {"enabled": plan.dtype == "bfloat16"},
        "fp16": {"enabled": plan.dtype == "float16", "loss_scale": 0, "initial_scale_power": 16},
        "steps_per_print": NO_PRINT,
        "wall_clock_breakdown": False,
    }
    if opts["offload_optimizer"] != "none":
        # DeepSpeed steps an offloaded optimizer with its own C++ Adam (DeepSpeedCPUAdam, compiled on first
        # use) and refuses a client torch optimizer there, so the optimizer is rendered into the config.
        config["optimizer"] = {
            "type": "AdamW",
            "params": {
                "lr": cfg.training.lr,
                "weight_decay": cfg.training.weight_decay,
                "betas": [0.9, 0.999],
                "eps": 1e-8,
            },
        }
        reasons.append(
            f"deepspeed optimizer offload to {opts['offload_optimizer']}: DeepSpeed's own AdamW "
            "(DeepSpeedCPUAdam) takes the optimizer step on the host, with torch AdamW's settings"
        )
    return config, reasons


def render_zeropp(config: dict, reasons: list[str], plan) -> tuple[dict, list[str]]:
    """ZeRO++'s additions to ZeRO-3's JSON (``config``): the hierarchical partition and the quantized
    collectives, each with its reason."""
    opts, zero = plan.strategy_options, config["zero_optimization"]
    hpz = opts["hpz_partition_size"] or (plan.processes_per_machine if plan.num_machines > 1 else 1)
    if opts["hpz_partition_size"]:
        reasons.append(f"zero++ hpZ partition {hpz} (explicit)")
    elif hpz > 1:
        reasons.append(
            f"zero++ hpZ partition {hpz}: a secondary copy of the weights is sharded within each machine, so "
            "forward and backward all-gathers stay on the intra-node links"
        )
    else:
        reasons.append("zero++ hpZ off: one machine, so the secondary partition would equal the primary one")
    weights, grads = opts["quantized_weights"], opts["quantized_gradients"]
    if weights is None:
        weights = plan.device == "cuda" and plan.dtype != "bfloat16"
        why = (
            "CPU run: DeepSpeed's quantizer kernels are CUDA-only"
            if plan.device == "cpu"
            else "bfloat16 run: qwZ dequantizes to float16, which bf16 layers reject"
            if plan.dtype == "bfloat16"
            else "int8 all-gather halves weight traffic"
        )
        reasons.append(f"zero++ quantized weights {'on' if weights else 'off'} (auto): {why}")
    if grads is None:
        grads = plan.device == "cuda"
        why = "int4 reduce-scatter quarters gradient traffic" if grads else "CPU run: CUDA-only kernels"
        reasons.append(f"zero++ quantized gradients {'on' if grads else 'off'} (auto): {why}")
    zero.update(
        {
            "zero_quantized_weights": bool(weights),
            "zero_quantized_gradients": bool(grads),
            "zero_hpz_partition_size": int(hpz),
        }
    )
    return config, reasons


def validate_with_deepspeed(config: dict, world_size: int) -> None:
    """Check a rendered config with DeepSpeed's own config model, as one rank of ``world_size`` would see it.

    DeepSpeed checks the batch arithmetic against the process group's size, which does not exist
    before launch, so the batch fields are scaled to one rank; the planner checked them for the world.

    Raises:
        ValueError: DeepSpeed rejected the config (its message is kept).
    """
    import_deepspeed()
    from deepspeed.runtime.config import DeepSpeedConfig

    one_rank = {**config, "train_batch_size": config["train_batch_size"] // world_size}
    DeepSpeedConfig(one_rank)
