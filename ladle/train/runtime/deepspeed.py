"""The worker side of ``ladle.strategies.deepspeed``: wrap, step, gather and save (the strategy there decides; this applies)."""

from __future__ import annotations

from contextlib import ExitStack, contextmanager, nullcontext

from ladle.platform import storage
from ladle.strategies.deepspeed_import import import_deepspeed
from ladle.train.runtime.base import Runtime
from ladle.train.runtime.zero import (  # no torch at import: each imports what it needs when called
    fill_partitioned,
    keep_ends_local,
    local_ends,
    one_dtype,
    share_master,
)


def cpu_without_shm_kernel(plan) -> None:
    """On CPU, keep DeepSpeed from compiling its shared-memory all-reduce kernel (see ``ladle.strategies.deepspeed``'s docstring)."""
    if plan.device == "cpu":
        import_deepspeed()
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def numel(param) -> int:
    return int(getattr(param, "ds_numel", param.numel()))


class ZeRORuntime(Runtime):
    """The worker side of ``ZeRO`` (``ladle.strategies.deepspeed``): what a rank does with the model."""

    def empty_context(self, plan, dtype):
        """ZeRO-3 builds the model under ``deepspeed.zero.Init``: each parameter is partitioned as its module is
        created, so no rank ever holds the whole model; stages 1 and 2 keep a full replica (the meta device)."""
        if self.strategy.stage < 3:
            return super().empty_context(plan, dtype)
        deepspeed = import_deepspeed()
        from transformers.initialization import no_init_weights
        from transformers.integrations.deepspeed import prevent_arange_dtype_change

        cpu_without_shm_kernel(plan)
        # zero.Init partitions over DeepSpeed's communicator: attach it to the process group accelerate made.
        deepspeed.init_distributed(dist_backend=plan.backend, dist_init_required=False)
        # transformers' own ZeRO-3 construction, less its random init (every weight is loaded afterwards):
        # init functions skipped (they would index the empty partitions), RoPE buffers kept in float32.
        stack = ExitStack()
        stack.enter_context(no_init_weights())
        stack.enter_context(prevent_arange_dtype_change())
        # No dtype argument: DeepSpeed 0.19 reads `dtype or fp16 if fp16_supported else ...` without parentheses,
        # so on a CPU accelerator any dtype passed becomes bfloat16. The config's bf16/fp16 flags (rendered from
        # the plan's dtype) give the same dtype correctly.
        stack.enter_context(deepspeed.zero.Init(config_dict_or_path=dict(plan.launcher_config)))
        return stack

    def place(self, accelerator, model, plan, pending) -> tuple[bool, object, dict]:
        """Load what ``pending`` says the model lacks, each rank its part (ZeRO-3: its partitions, and the ends
        kept local where the plan says); whether all-gathers run in place, and the local ends' notes."""
        from ladle.train.runtime.gloo_gather import use_in_place_gather_for_zero3

        cpu_without_shm_kernel(plan)
        in_place = self.strategy.stage == 3 and use_in_place_gather_for_zero3(accelerator.device)
        vocab, notes = None, {}
        if pending is None:
            model.to(accelerator.device)
        elif self.strategy.stage == 3:
            vocab, notes = keep_ends_local(model, pending, plan.strategy_options, accelerator.device)
            fill_partitioned(model, pending, accelerator.is_main_process)
        else:
            pending.fill(model, accelerator.device)
        if self.strategy.stage == 3:
            one_dtype(model, plan.dtype)
        return in_place, vocab, notes

    def wrap_frozen(self, accelerator, model, plan, pending):
        """ZeRO-3 with no optimizer: DeepSpeed then installs only its fetch-and-release hooks (ZeRO-Offload),
        so the frozen copy stays partitioned and each forward gathers a layer at a time, as the trained model's
        does. The rest of the config is the run's (precision, ZeRO-3's buckets and thresholds)."""
        deepspeed = import_deepspeed()

        self.place(accelerator, model, plan, pending)
        config = {k: v for k, v in plan.launcher_config.items() if k not in ("optimizer", "scheduler")}
        zero = {k: v for k, v in config.get("zero_optimization", {}).items() if k != "offload_optimizer"}
        config["zero_optimization"] = zero
        engine, *_ = deepspeed.initialize(model=model, config=config, dist_init_required=False)
        return engine

    def wrap(self, accelerator, model, make_optimizer, plan, pending=None):
        deepspeed = import_deepspeed()

        in_place, vocab, notes = self.place(accelerator, model, plan, pending)
        config = dict(plan.launcher_config)
        if "optimizer" in config:
            # Optimizer offload: DeepSpeed builds its own optimizer from the config (DeepSpeedCPUAdam for the
            # host step); it refuses a client torch optimizer with offload (zero_force_ds_cpu_optimizer).
            trainable = [p for p in model.parameters() if p.requires_grad]
            engine, optimizer, _, _ = deepspeed.initialize(
                model=model, model_parameters=trainable, config=config, dist_init_required=False
            )
        else:
            engine, optimizer, _, _ = deepspeed.initialize(
                model=model, optimizer=make_optimizer(model), config=config, dist_init_required=False
            )
        engine.ladle_all_gather = "in place" if in_place else "deepspeed"
        engine.ladle_master = share_master(optimizer, self.strategy.stage)
        engine.ladle_vocab, engine.ladle_vocab_notes = vocab, notes
        return engine, optimizer

    def check_applied(self, accelerator, model, plan) -> dict:
        from deepspeed import DeepSpeedEngine

        if not isinstance(model, DeepSpeedEngine):
            raise RuntimeError(
                f"{self.strategy.name} planned but the model is {type(model).__name__}, not a DeepSpeedEngine"
            )
        if model.zero_optimization_stage() != self.strategy.stage:
            raise RuntimeError(
                f"{self.strategy.name} planned but DeepSpeed runs ZeRO stage {model.zero_optimization_stage()}"
            )
        trainable = [p for p in model.module.parameters() if p.requires_grad]
        total = sum(numel(p) for p in trainable)
        opt = model.optimizer
        if self.strategy.stage == 3:
            local_state = sum(t.numel() for t in opt.fp32_partitioned_groups_flat)
            local_params = sum(p.ds_tensor.numel() for p in model.module.parameters())
            full_params = sum(p.ds_numel for p in model.module.parameters())
            for end in local_ends(model.module):  # rows held outside ZeRO's partitioning (keep_ends_local)
                local_params += end.weight.numel()
                full_params += end.ladle_rows * end.weight.shape[1]
            param_share = local_params / full_params
        else:
            local_state = sum(t.numel() for t in opt.single_partition_of_fp32_groups)
            param_share = 1.0
        state_share = local_state / max(total, 1)
        world = accelerator.num_processes
        if world > 1 and state_share > 1 / world + 0.05:
            raise RuntimeError(
                f"{self.strategy.name} planned but this rank holds {state_share:.0%} of the optimizer state"
            )
        return {
            "wrapper": "DeepSpeedEngine",
            "zero_stage": self.strategy.stage,
            "parameter_share": param_share,
            "optimizer_state_share": state_share,
            "gradients_partitioned": self.strategy.stage >= 2,
            "trainable_numel": total,
            "all_gather": getattr(model, "ladle_all_gather", "deepspeed"),
            "master_weights": model.ladle_master,
            **getattr(model, "ladle_vocab_notes", {}),
        }

    def no_sync(self, accelerator, model):
        return nullcontext()  # the engine knows the accumulation boundary from its config

    def backward(self, accelerator, model, loss, boundary: bool) -> None:
        # ladle scales the loss itself (global token mean), so DeepSpeed must not divide by the accumulation.
        model.backward(loss, scale_wrt_gas=False)
        if not boundary:
            model.step()  # counts the micro-step; the engine steps the optimizer only at the boundary

    def optimizer_step(self, accelerator, model, optimizer, max_grad_norm: float) -> None:
        model.step()  # clipping (gradient_clipping), step and zero_grad happen inside the engine

    def unwrap(self, accelerator, model):
        return accelerator.unwrap_model(model)  # the engine's module (accelerate knows DeepSpeedEngine)

    @contextmanager
    def whole_weights(self, accelerator, model):
        """ZeRO-3: every parameter gathered whole on every rank (``GatheredParameters``, one collective on entry,
        the partitions kept as they were on exit: nothing is modified), and the engine's fetch-and-release hooks
        taken off the modules meanwhile, so the sampler's forwards (as many as each rank's completions need, a
        different number on each rank) run locally without a collective. The hooks go back on after, with the
        fetch order DeepSpeed traced invalidated (the sampler's forwards were not the training step's)."""
        if self.strategy.stage < 3:
            yield
            return
        deepspeed = import_deepspeed()
        with deepspeed.zero.GatheredParameters(list(model.module.parameters())):
            offload = zero3_offload(model)
            for param in model.module.parameters():
                param.ds_active_sub_modules.clear()
            for hook in [*offload.forward_hooks, *offload.backward_hooks]:
                hook.remove()
            offload.forward_hooks, offload.backward_hooks = [], []
            try:
                yield
            finally:
                coordinator = getattr(offload, "param_coordinator", None)
                if coordinator is not None and not coordinator.is_invalid_trace():
                    coordinator._invalidate_trace()
                offload._register_deepspeed_module(offload.module)

    def full_state_dict(self, accelerator, model, trainable_only: bool) -> dict | None:
        """The (trainable) parameters whole on rank 0 (None elsewhere), gathered one at a time (``whole``)."""
        self.settle(model)
        out: dict = {}
        for name, param in model.module.named_parameters():
            if param.requires_grad or not trainable_only:
                with self.whole(param) as full:
                    if accelerator.is_main_process:
                        out[name] = full.detach().to("cpu", copy=True)
        return out if accelerator.is_main_process else None

    def full_model_parts(self, accelerator, model, max_bytes: int):
        self.settle(model)
        yield from super().full_model_parts(accelerator, model, max_bytes)

    def settle(self, model) -> None:
        """ZeRO-3: release every parameter a forward left fetched or still in flight before gathering outside one.

        On CUDA the engine prefetches the next modules' parameters on a side stream (overlap_comm), so after the
        last eval forward some are INFLIGHT, and a ``GatheredParameters`` over one of them fails on exit
        ("Cannot partition a param in flight"; seen saving a full fine-tune on an H200). ``empty_partition_cache``
        waits for those fetches and partitions everything again.
        """
        if self.strategy.stage == 3:
            model.empty_partition_cache()

    @contextmanager
    def whole(self, tensor):
        """A ZeRO-3 partitioned parameter gathered for the context (on every rank); anything else as it is."""
        if not hasattr(tensor, "ds_id"):
            yield tensor
            return
        deepspeed = import_deepspeed()

        with deepspeed.zero.GatheredParameters([tensor], modifier_rank=None):
            yield tensor

    def save_state(self, model, optimizer, folder: str, tag: str) -> dict:
        model.save_checkpoint(folder, tag=tag, save_latest=False)
        return {}  # everything is in DeepSpeed's per-rank files

    def load_state(self, model, optimizer, payload: dict, url: str, tag: str) -> None:
        # DeepSpeed reads local files, and every rank opens every rank's ZeRO partition file (its elastic
        # loading; stage 3 then keeps its own): a remote checkpoint is downloaded whole, as DeepSpeed would read it.
        with storage.local_dir(url) as folder:
            path, _ = model.load_checkpoint(
                str(folder), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=False
            )
        if path is None:
            raise RuntimeError(f"DeepSpeed found no checkpoint {tag} in {url}")
        if self.strategy.stage == 3:
            # Loading gathers parameters outside any forward; left gathered, they put the first step's fetches
            # out of the order DeepSpeed traced, and with a small stage3_max_live_parameters it raises
            # "tracing error" (measured on a resumed LoRA run). Partition everything again first.
            model.empty_partition_cache()


def zero3_offload(engine):
    """The ZeRO-3 engine's parameter coordinator object, which owns the modules' hooks."""
    optimizer = engine.optimizer
    if optimizer is None:
        raise RuntimeError("zero3: the engine has no optimizer, so its parameter hooks cannot be found")
    return getattr(optimizer, "parameter_offload", optimizer)


class ZeROPlusPlusRuntime(ZeRORuntime):
    """The worker side of ``ZeROPlusPlus`` (``ladle.strategies.deepspeed``): what a rank does with the model."""

    def check_applied(self, accelerator, model, plan) -> dict:
        verified = super().check_applied(accelerator, model, plan)
        planned = plan.launcher_config["zero_optimization"]
        running = {
            "zero_hpz_partition_size": model.zero_hpz_partition_size(),
            "zero_quantized_weights": model.zero_quantized_weights(),
            "zero_quantized_gradients": model.zero_quantized_gradients(),
        }
        for key, value in running.items():
            if value != planned[key]:
                raise RuntimeError(f"zero++ planned {key}={planned[key]} but DeepSpeed runs {value}")
        hpz = int(running["zero_hpz_partition_size"])
        if hpz > 1:
            secondary = [p for p in model.module.parameters() if getattr(p, "ds_secondary_tensor", None) is None]
            if secondary:
                raise RuntimeError(
                    f"zero++ planned hpZ {hpz} but {len(secondary)} parameter(s) have no secondary shard"
                )
        return {
            **verified,
            "hpz_partition_size": hpz,
            "quantized_weights": running["zero_quantized_weights"],
            "quantized_gradients": running["zero_quantized_gradients"],
        }
