"""Pipeline parallelism with ``torch.distributed.pipelining``: one stage per rank.

The Hugging Face decoder (Llama, Mistral, Qwen families: ``model.embed_tokens``,
``model.layers``, ``model.norm``, ``lm_head``) is split by hand: each rank
keeps a contiguous run of decoder layers, the first also the embedding, the
last also the final norm and the head; every other module is dropped, so the
rank really holds only its share. Layers stay under their original names (a
``ModuleDict`` keyed by layer index), so adapters and checkpoints use the same
keys as every other strategy and the saved output is a normal HF folder.

Each optimizer step sends the whole global batch through the schedule (GPipe
or 1F1B) as ``gradient_accumulation`` microbatches of ``micro_batch_size``
rows. The loss is the sum over trained tokens divided by the batch's token
count, so gradients are not rescaled by the microbatch count (``scale_grads``
off) and equal the single-process gradients.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ladle import sizing
from ladle.platform import storage
from ladle.section import Section
from ladle.sizing import memory
from ladle.strategies.base import Candidate, Strategy
from ladle.strategies.mesh import Dims
from ladle.strategies.registry import register


class PipelineOptions(Section):
    stages: int = Field(2, ge=1, le=16, description="Pipeline stages (pipeline_stages), one per process; >= 2.")
    schedule: Literal["1f1b", "gpipe"] = Field(
        "1f1b",
        description="1f1b: one-forward-one-backward, activations of at most `stages` microbatches alive; "
        "gpipe: all forwards, then all backwards.",
    )
    allow_cpu: bool = Field(
        False, description="Run the stages as CPU gloo processes (for testing on a machine without GPUs)."
    )


class Pipeline(Strategy):
    name = "pipeline"
    summary = "pipeline parallel (torch.distributed.pipelining): decoder layers split into stages, one per rank"
    options_model = PipelineOptions
    options_section = "pipeline"

    # -- planner side --------------------------------------------------------

    def processes(self, cfg, device: str, per_machine: int) -> tuple[int, str | None]:
        stages = cfg.parallelism.pipeline.stages
        if device == "cuda" and cfg.parallelism.gpus == "auto" and per_machine > stages:
            return stages, f"{stages} process(es): --gpus auto adapts to one pipeline of {stages} stages"
        return per_machine, None

    def dims(self, options, world_size: int, nodes: int) -> Dims:
        return Dims(pp=world_size)

    def data_parallel_degree(self, world_size: int, options) -> int:
        return 1  # one pipeline: its stages share one batch

    def default_accumulation(self, options) -> int:
        return options.stages  # one microbatch per stage fills the pipeline (what 1F1B needs)

    def validate_batch(self, options, micro: int, accumulation: int, global_batch: int) -> list[str]:
        if options.schedule != "1f1b" or accumulation >= options.stages:
            return []
        return [
            f"training.global_batch_size = {global_batch}: 1f1b needs at least one microbatch per stage "
            f"({accumulation} < {options.stages}). Use global_batch_size={micro * options.stages} or more, "
            "or parallelism.pipeline.schedule=gpipe."
        ]

    def candidates(self, job, interconnect, cfg) -> list[Candidate]:
        possible = 2 <= job.world <= 16 and job.shape.layers >= job.world
        if job.lora or not possible or not (job.cuda or cfg.parallelism.pipeline.allow_cpu):
            return []
        why = (
            "the model does not fit one node's devices even fully sharded: split layers into stages; only "
            "activations cross the links"
        )
        reason = f"pipeline of {job.world} stages: one per process"
        return [Candidate(self, 50, why, {"stages": job.world}, reason=reason)]

    def model_states(self, job, options) -> memory.ModelStates:
        """The fullest stage, a full replica of its slice: the first stage's share of the layers (it takes the
        remainder) and one end (the embedding; the last stage holds the head). Float32 weights, gradients and
        AdamW's moments in a float32 run (CPU), the mixed-precision layout otherwise. Measured on bench/memory.py's
        deep model (28 layers, 32k vocabulary): 4 stages put 0.293 of the weights on stage 0, not 1/4."""
        s = job.shape
        end = s.embedding_params // 2 if s.untied else s.embedding_params
        params = min(s.params, s.layer_params * -(-s.layers // job.world) + end)
        return memory.fp32(params) if job.dtype_bytes == 4 else memory.ddp(params)

    def lora_base_ranks(self, job, options) -> int:
        return job.world

    def activations(self, job, options) -> tuple[int, str]:
        s, tokens, layers = job.shape, job.micro_batch * job.seq_len, -(-job.shape.layers // job.world)
        in_flight = min(job.microbatches, job.world)  # 1F1B: at most `stages` microbatches alive on stage 0
        acts = in_flight * sizing.activation_bytes(s, tokens, layers, job.dtype_bytes, job.checkpointing)
        return acts, f"{job.world} stages of {layers} layers, {in_flight} microbatches in flight"

    def validate(self, cfg, topo, target) -> list[str]:
        pp, world_size = cfg.parallelism.pipeline, target.world_size
        problems = []
        if pp.stages < 2:
            problems.append(
                f"parallelism.pipeline.stages = {pp.stages}: a pipeline needs at least 2 stages. "
                "Set parallelism.pipeline.stages=2 or more, or use another strategy."
            )
        if topo.gpu_count == 0 and not pp.allow_cpu:
            problems.append(
                "parallelism.strategy = pipeline: on a CPU host each stage is a gloo process, which is for testing, "
                "not speed. Set parallelism.pipeline.allow_cpu=true to run it anyway, or run on a GPU host."
            )
        elif world_size != pp.stages:
            if topo.gpu_count and world_size < pp.stages:
                fix = f"Use at most {world_size} stages: --set parallelism.pipeline.stages={world_size}"
            elif topo.gpu_count:
                fix = f"Train on {pp.stages} GPUs: --gpus {pp.stages} (or --gpus auto)"
            else:
                fix = f"Set parallelism.cpu_processes={pp.stages}"
            problems.append(
                f"parallelism.pipeline.stages = {pp.stages}: ladle runs one pipeline, one stage per process, "
                f"but the plan has {world_size} process(es). {fix}."
            )
        return problems

    def configure(self, cfg, plan) -> tuple[dict, list[str]]:
        pp = cfg.parallelism.pipeline
        config = {
            "stages": pp.stages,
            "schedule": pp.schedule,
            "microbatches": plan.gradient_accumulation,
            "microbatch_rows": plan.micro_batch_size,
        }
        reasons = [
            f"pipeline {pp.schedule}: {pp.stages} stages, each step {plan.gradient_accumulation} microbatches "
            f"of {plan.micro_batch_size} rows"
        ]
        return config, reasons

    def wrap(self, accelerator, model, make_optimizer, plan, pending=None):
        """Split off this rank's stage (of an empty skeleton when ``pending``: the stage then reads only its
        own layers' tensors) and build its schedule."""
        from ladle.strategies.runtime.pipeline_stage import (
            StageModule,
            build_pipeline,
            causal_lm,
            refuse_trained_tied_embeddings,
        )

        refuse_trained_tied_embeddings(
            causal_lm(model), "keep them frozen (LoRA without modules_to_save on embeddings/head) or use fsdp2"
        )
        stages, stage = plan.world_size, accelerator.process_index
        part = StageModule(model, stage, stages)
        if pending is not None:
            pending.fill(part.wrapped, accelerator.device)
        part.to(accelerator.device)
        kind, microbatches = plan.launcher_config["schedule"], plan.gradient_accumulation
        return build_pipeline(part, model, stage, stages, accelerator.device, kind, microbatches), make_optimizer(part)

    def check_applied(self, accelerator, model, plan) -> dict:
        import torch

        part = model.stage_module
        local = sum(p.numel() for p in part.parameters())
        total = torch.tensor([local], dtype=torch.float64, device=accelerator.device)
        total = float(accelerator.reduce(total, reduction="sum")[0])
        if len(part.layer_ids) == 0:
            raise RuntimeError(f"pipeline stage {model.stage} holds no decoder layers (too many stages for the model)")
        return {
            "wrapper": "PipelineStage",
            "stage": model.stage,
            "stages": model.stages,
            "schedule": model.kind,
            "layers_on_rank0": part.layer_ids,
            "parameter_share": local / total,
        }

    def no_sync(self, accelerator, model):
        from contextlib import nullcontext

        return nullcontext()

    def forward_backward(self, accelerator, model, data, batch, plan, denominator, loss_fn) -> float:
        return model.train_rows(
            data, batch, accelerator.device, denominator
        )  # the raw token sum; zero off the last stage

    def optimizer_step(self, accelerator, model, optimizer, max_grad_norm: float) -> None:
        import torch

        params = [p for p in model.stage_module.parameters() if p.requires_grad and p.grad is not None]
        if max_grad_norm > 0:
            # The norm is global: each stage's squared norm, summed over stages.
            local = sum((p.grad.detach().float() ** 2).sum() for p in params) if params else torch.zeros(())
            squared = torch.tensor([float(local)], dtype=torch.float64, device=accelerator.device)
            norm = float(accelerator.reduce(squared, reduction="sum")[0]) ** 0.5
            scale = min(1.0, max_grad_norm / (norm + 1e-6))
            for p in params:
                p.grad.mul_(scale)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def eval_micro_batch(self, job, options) -> tuple[int, str]:
        return job.micro_batch, "the training micro-batch: the stages' shapes are fixed"

    def evaluate(self, accelerator, model, data, micro: int, loss_fn=None) -> float:
        import torch

        with torch.no_grad():
            return self._evaluate(accelerator, model, data, micro)

    def _evaluate(self, accelerator, model, data, micro: int) -> float:
        import torch

        from ladle.strategies.runtime.pipeline_stage import IGNORE

        rows = len(data["input_ids"])
        chunk = micro * model.schedule._n_microbatches
        total = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
        model.loss.denominator = 1.0
        for start in range(0, rows, chunk):
            index = [min(i, rows - 1) for i in range(start, start + chunk)]  # pad the tail by repeating the last row...
            ids, positions = data["input_ids"][index], data["position_ids"][index]
            labels = data["labels"][index].clone()
            labels[rows - start :] = IGNORE  # ...whose labels are ignored, so it adds nothing
            device = accelerator.device
            losses = model.run(ids.to(device), labels.to(device), positions.to(device), train=False)
            total[0] += sum(float(x) for x in losses)
            total[1] += int((labels[:, 1:] != IGNORE).sum()) if model.stage == 0 else 0
        total = accelerator.reduce(total, reduction="sum")
        return float(total[0] / max(total[1], 1))

    def hf_model(self, accelerator, model):
        return model.skeleton()

    def full_state_dict(self, accelerator, model, trainable_only: bool) -> dict | None:
        from ladle.strategies.runtime.pipeline_stage import gather_to_rank0

        return gather_to_rank0(stage_tensors(model, trainable_only), accelerator.device)

    def full_model_parts(self, accelerator, model, max_bytes: int):
        """The stages' weights sent to rank 0 in parts of at most ``max_bytes``, each written before the next is
        sent (``gather_parts_to_rank0``): rank 0 holds its stage, one part and one tensor, not the model."""
        from ladle.strategies.runtime.pipeline_stage import gather_parts_to_rank0

        yield from gather_parts_to_rank0(stage_tensors(model, False), accelerator.device, max_bytes)

    native_checkpoint = True

    def save_state(self, model, optimizer, folder: str, tag: str) -> dict:
        from pathlib import Path

        import torch

        target = Path(folder) / tag
        target.mkdir(parents=True, exist_ok=True)
        torch.save(
            {
                "model": model.stage_module.state_dict(),
                "optimizer": optimizer.state_dict(),
                "layers": model.stage_module.layer_ids,
            },
            target / f"stage-{model.stage:03d}.pt",
        )
        return {}  # everything is in this rank's file

    def load_state(self, model, optimizer, payload: dict, url: str, tag: str) -> None:
        import io

        import torch

        # This stage's file only, wherever the checkpoint is stored.
        data = storage.read_bytes(storage.join(url, tag, f"stage-{model.stage:03d}.pt"))
        state = torch.load(io.BytesIO(data), weights_only=True)  # a checkpoint is data: never code to run
        if state["layers"] != model.stage_module.layer_ids:
            raise RuntimeError(
                f"pipeline checkpoint stage {model.stage} holds layers {state['layers']}, this run "
                f"{model.stage_module.layer_ids}"
            )
        model.stage_module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])


def stage_tensors(model, trainable_only: bool) -> dict:
    """This rank's stage parameters (all, or the trained ones) under the model's own names, where they live
    (``gather_parts_to_rank0`` copies one at a time to the host)."""
    part = model.stage_module.wrapped
    return {n: p for n, p in part.named_parameters() if p.requires_grad or not trainable_only}


register(Pipeline())
