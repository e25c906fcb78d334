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
from ladle.section import Section
from ladle.sizing import memory
from ladle.strategies.base import Candidate, Strategy
from ladle.strategies.catalog import register
from ladle.strategies.mesh import Dims


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
    runtime = "ladle.train.runtime.pipeline:PipelineRuntime"
    """Where its worker side is (``ladle.train.runtime``): imported by the worker only."""
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

    def pairs_refusal(self, options) -> str | None:
        return (
            "pipeline stages compute the loss inside the schedule on the last stage, token sums only; the pair "
            "loss needs each side's summed log-probability and its reference beside it there, which the schedule "
            "does not carry"
        )

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

    def eval_micro_batch(self, job, options) -> tuple[int, str]:
        return job.micro_batch, "the training micro-batch: the stages' shapes are fixed"

    native_checkpoint = True


register(Pipeline())
