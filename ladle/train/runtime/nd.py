"""The worker side of ``ladle.strategies.nd``: wrap, step, gather and save (the strategy there decides; this applies)."""

from __future__ import annotations

from contextlib import nullcontext

from ladle.strategies.mesh import Dims
from ladle.train.runtime.base import Runtime, dcp_load, dcp_save


class NDRuntime(Runtime):
    """The worker side of ``ND`` (``ladle.strategies.nd``): what a rank does with the model."""

    def wrap(self, accelerator, model, make_optimizer, plan, pending=None):
        """Split into this rank's stage, then tp, then FSDP on the data-parallel sub-mesh; then read this
        rank's region of every tensor, and build the optimizer over what it holds."""
        import torch
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from ladle.strategies.mesh import device_mesh
        from ladle.train.kernels import decoder_layers
        from ladle.train.loading import run_dtype
        from ladle.train.runtime import mesh_parallel as mp
        from ladle.train.runtime.pipeline_stage import (
            StageModule,
            build_pipeline,
            causal_lm,
            refuse_trained_tied_embeddings,
        )

        dims = Dims.of(plan.mesh)
        self.mesh = mesh = device_mesh(accelerator.device.type, dims)
        device = accelerator.device
        part, lm, stage = model, causal_lm(model), mesh["pp"].get_local_rank()
        if dims.pp > 1:
            refuse_trained_tied_embeddings(lm, "keep them frozen (LoRA) or use parallelism.dims.pp=1")
            part = StageModule(model, stage, dims.pp)
        layers = decoder_layers(part)
        if dims.sp > 1:
            from ladle.train import sequence_parallel

            sequence_parallel.install(model, mesh["sp"].get_group())
        if dims.tp > 1:
            mp.apply_tensor_parallel(layers, mesh["tp"])
        if dims.dp * dims.sp > 1:
            compute = run_dtype(plan)
            shard = "dp_shard_sp" if dims.sp > 1 else "dp_shard"  # the sp ranks shard and reduce with dp_shard's
            dp_mesh = mesh["dp_replicate", shard] if dims.dp_replicate > 1 else mesh[shard]
            options = {
                "mesh": dp_mesh,
                "mp_policy": MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32),
            }
            for layer in layers:
                fully_shard(layer, **options)
            for unit in mp.stage_units(lm):
                fully_shard(unit, **options)
            fully_shard(part, **options)
        if pending is not None:
            pending.fill(model, device)
        else:
            part.to(device)
        optimizer = make_optimizer(part)
        if dims.pp == 1:
            return model, optimizer
        kind, microbatches, group = (
            plan.strategy_options["schedule"],
            plan.gradient_accumulation,
            mesh["pp"].get_group(),
        )
        return build_pipeline(part, model, stage, dims.pp, device, kind, microbatches, group), optimizer

    def check_applied(self, accelerator, model, plan) -> dict:
        """Every parameter placed as planned on every mesh dimension: tp splits the projections (Shard(0) for
        colwise, Shard(1) for rowwise), dp_shard shards every parameter on dim 0, dp_replicate replicates."""
        import torch
        from torch.distributed.tensor import DTensor, Replicate

        from ladle.train.kernels import decoder_layers
        from ladle.train.runtime import mesh_parallel as mp
        from ladle.train.runtime.pipeline_stage import causal_lm

        dims = Dims.of(plan.mesh)
        part = mp.module_of(model)
        wrong, placements, local, stage_total = [], {}, 0, 0
        for name, p in part.named_parameters():
            local += p.to_local().numel() if isinstance(p, DTensor) else p.numel()
            stage_total += p.numel()
            found = mp.placed(p)
            problem = mp.misplaced(name, found, dims)
            if problem:
                wrong.append(problem)
            if any(key in name for key in ("layers.", "embed_tokens", "lm_head")):
                short = name.removeprefix("wrapped.")
                shown = {dim: repr(placement) for dim, placement in found.items()}
                placements.setdefault(mp.kind_of(short), {"parameter": short, "placements": shown})
        if wrong:
            raise RuntimeError(f"nd planned {dims.describe()} but {len(wrong)} parameter(s) are misplaced: {wrong[0]}")
        # Each stage's global size once: summed over ranks, then divided by the ranks of a stage.
        total = torch.tensor([float(stage_total)], dtype=torch.float64, device=accelerator.device)
        total = float(accelerator.reduce(total, reduction="sum")[0]) / (dims.world // dims.pp)
        checked = {
            "wrapper": "N-D mesh",
            "mesh": dims.degrees(),
            "placements": placements,
            "parameter_share": local / total,
            "decoder_layers": len(decoder_layers(part)),
            "fsdp": dims.dp * dims.sp > 1 and all(isinstance(p, DTensor) for p in part.parameters()),
            "tp_sharded_projections": sum(
                1
                for n, p in part.named_parameters()
                if isinstance(p, DTensor) and "tp" in p.device_mesh.mesh_dim_names and n.endswith("proj.weight")
            ),
            "replicated_over_dp_replicate": dims.dp_replicate > 1
            and all(isinstance(p.placements[0], Replicate) for p in part.parameters() if isinstance(p, DTensor)),
        }
        if dims.sp > 1:
            implementation = getattr(causal_lm(model).config, "_attn_implementation", None)
            from ladle.train.sequence_parallel import NAME

            if implementation != NAME:
                raise RuntimeError(f"nd planned sp={dims.sp} but the model's attention is {implementation!r}")
            checked["sequence_parallel"] = {"sp": dims.sp, "attention": implementation, "fsdp_over": "dp_shard × sp"}
        if dims.pp > 1:
            checked.update({"stage": model.stage, "stages": dims.pp, "layers": part.layer_ids, "schedule": model.kind})
        return checked

    def data_parallel(self, accelerator) -> tuple[int, int]:
        return self.mesh["dp"].get_local_rank(), self.mesh["dp"].size()

    def sequence_split(self) -> int:
        return self.mesh["sp"].size()

    def no_sync(self, accelerator, model):
        """A micro-batch before the step's last. Where FSDP2 shards (dp_shard x sp > 1) its gradients are
        reduce-scattered as every micro-batch ends, so they accumulate sharded, as the plan sizes them (held back,
        each rank would keep the whole stage's in float32: ``parallelism.fsdp2.gradient_sync``'s
        ``each_microbatch``); the all-reduce across dp_replicate waits for the last. With dp_replicate alone
        nothing is sharded, so the whole reduction waits."""
        from ladle.train.runtime import mesh_parallel as mp

        module = mp.module_of(model)
        if not hasattr(module, "set_requires_gradient_sync"):
            return nullcontext()
        shard = self.mesh["dp_shard"].size() * self.mesh["sp"].size()
        if shard == 1:
            return mp.no_gradient_sync(module)
        return mp.no_all_reduce(module) if self.mesh["dp_replicate"].size() > 1 else nullcontext()

    def forward_backward(self, accelerator, model, data, batch, plan, denominator, loss_fn) -> float:
        if not hasattr(model, "schedule"):
            return super().forward_backward(accelerator, model, data, batch, plan, denominator, loss_fn)
        from ladle.train import schedule

        rank, replicas = self.data_parallel(accelerator)
        rows = [r for micro in schedule.micro_batches(batch, rank, replicas, plan.micro_batch_size) for r in micro]
        # FSDP averages gradients over the replicas: scale so the result is the global token mean.
        raw = model.train_rows(data, rows, accelerator.device, denominator / replicas)  # this replica's token sum
        return raw / Dims.of(plan.mesh).tp  # the tp ranks of a stage computed the same sum

    def evaluate(self, accelerator, model, data, micro: int, loss_fn) -> float:
        if not hasattr(model, "schedule"):
            return super().evaluate(accelerator, model, data, micro, loss_fn)
        from ladle.train.runtime.base import runtime_for

        # Every pipeline evaluates every row: the sums over all ranks count each row dp × tp times in both
        # the loss and the token count, so their ratio is the eval loss.
        return runtime_for("pipeline").evaluate(accelerator, model, data, micro)

    def optimizer_step(self, accelerator, model, optimizer, max_grad_norm: float) -> None:
        from ladle.train.runtime import mesh_parallel as mp

        params = [p for p in mp.module_of(model).parameters() if p.requires_grad and p.grad is not None]
        if max_grad_norm > 0:
            pp_group = self.mesh["pp"].get_group() if self.mesh["pp"].size() > 1 else None
            norm = mp.grad_norm(params, pp_group)
            scale = min(1.0, max_grad_norm / (norm + 1e-6))
            for p in params:
                p.grad.mul_(scale)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def full_state_dict(self, accelerator, model, trainable_only: bool) -> dict | None:
        """Each parameter gathered whole (collective over its own mesh); with stages, each stage's lead sends its
        tensors on to rank 0 (``gather_to_rank0``)."""
        from ladle.train.runtime import mesh_parallel as mp

        if self.mesh["pp"].size() == 1:
            mine = mp.gather_whole(mp.module_of(model), trainable_only, keep=accelerator.is_main_process)
            return mine if accelerator.is_main_process else None
        from ladle.train.runtime.pipeline_stage import gather_to_rank0

        tensors = self.stage_tensors(model, trainable_only)
        return gather_to_rank0(tensors, accelerator.device, self.stage_lead(), self.whole)

    def full_model_parts(self, accelerator, model, max_bytes: int):
        """Without pipeline stages every parameter is a DTensor over the whole mesh: gathered a part at a time
        (``Strategy.full_model_parts``). With stages, a part's tensors are made whole within their stage and
        its lead sends them to rank 0 (``gather_parts_to_rank0``), a part at a time."""
        if self.mesh["pp"].size() == 1:
            yield from super().full_model_parts(accelerator, model, max_bytes)
            return
        from ladle.train.runtime.pipeline_stage import gather_parts_to_rank0

        tensors = self.stage_tensors(model, False)
        yield from gather_parts_to_rank0(tensors, accelerator.device, max_bytes, self.stage_lead(), self.whole)

    def stage_lead(self) -> bool:
        """Whether this rank sends its stage's tensors to rank 0: the first of the stage's dp x tp ranks."""
        return self.mesh["dp"].get_local_rank() == 0 and self.mesh["tp"].get_local_rank() == 0

    def stage_tensors(self, model, trainable_only: bool) -> dict:
        """This rank's stage parameters (all, or the trained ones) under the model's own names."""
        from ladle.train.runtime import mesh_parallel as mp

        named = mp.module_of(model).named_parameters()
        return {n.removeprefix("wrapped."): p for n, p in named if p.requires_grad or not trainable_only}

    def forward_model(self, accelerator, model):
        """The wrapped model itself (``hf_model`` is a meta skeleton for saving); a pipeline's stages compute
        their own loss."""
        return self.hf_model(accelerator, model) if hasattr(model, "schedule") else model

    def hf_model(self, accelerator, model):
        from ladle.train.runtime.pipeline_stage import causal_lm
        from ladle.train.runtime.skeleton import meta_skeleton

        if hasattr(model, "skeleton"):
            return model.skeleton()
        peft_config = model.peft_config.get("default") if hasattr(model, "peft_config") else None
        return meta_skeleton(causal_lm(model).config, peft_config)

    def save_state(self, model, optimizer, folder: str, tag: str) -> dict:
        """Torch distributed checkpoint (DCP) of this rank's module (a stage, or the whole model)."""
        from ladle.train.runtime import mesh_parallel as mp

        dcp_save(mp.module_of(model), optimizer, folder, tag)
        return {}

    def load_state(self, model, optimizer, payload: dict, url: str, tag: str) -> None:
        from ladle.train.runtime import mesh_parallel as mp

        dcp_load(mp.module_of(model), optimizer, url, tag)
