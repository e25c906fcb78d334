"""DeepSpeed ZeRO stages 1, 2, 3 and ZeRO++, applied by ladle in the worker.

The DeepSpeed JSON is rendered from ladle's config by ``configure``
(``deepspeed_json``: no DeepSpeed import, so ``ladle plan`` stays fast),
validated by DeepSpeed's own config model before launch
(``validate_with_deepspeed``), and handed to
``deepspeed.initialize`` in each process with a plain torch AdamW as the client
optimizer. ladle calls ``deepspeed.initialize`` itself rather than handing
accelerate a DeepSpeed plugin, so what runs is verified by ``check_applied``
(engine type, ZeRO stage, the per-rank shares of parameters and optimizer
state) instead of trusted.

On CPU hosts DeepSpeed runs over gloo. Two of its CPU extras are C++ kernels
compiled at first use (shared-memory all-reduce, DeepSpeedCPUAdam); ladle turns
the all-reduce kernel off and uses torch's AdamW, so no process compiles code
mid-run (a compile killed halfway leaves a lock that hangs every later run).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from pydantic import Field

from ladle.section import Section
from ladle.sizing import memory
from ladle.strategies.base import Candidate, Strategy, gathered_for_save, weights_held
from ladle.strategies.catalog import register
from ladle.strategies.deepspeed_json import render_zero, render_zeropp, sub_group_elements, validate_with_deepspeed
from ladle.strategies.mesh import Dims


class DeepSpeedOptions(Section):
    offload_optimizer: Literal["none", "cpu", "nvme"] = Field(
        "none", description="ZeRO-Offload of optimizer state (and its step) to CPU or NVMe. CUDA runs only."
    )
    offload_param: Literal["none", "cpu", "nvme"] = Field(
        "none", description="ZeRO-Infinity parameter offload to CPU or NVMe. Stage 3 (zero3, zero++) and CUDA only."
    )
    nvme_path: str | None = Field(None, description="Local NVMe folder for `nvme` offload.")
    overlap_comm: bool = Field(True, description="Overlap gradient reduction with the backward pass.")
    reduce_bucket_size: int | Literal["auto"] = Field(
        "auto",
        description="Elements reduced per bucket (written to the DeepSpeed JSON as an integer). auto: hidden^2, "
        "Hugging Face's rule (DeepSpeed's own default, 5e8, is a 2 GB float32 buffer).",
    )
    stage3_prefetch_bucket_size: int | Literal["auto"] = Field(
        "auto", description="Stage 3: elements prefetched ahead. auto: 0.9 x hidden^2."
    )
    stage3_max_live_parameters: int | Literal["auto"] = Field(
        "auto",
        description="Stage 3: gathered parameters kept alive before release, in elements. auto: two decoder "
        "layers (or the largest tensor); DeepSpeed's 1e9 keeps a whole sub-1B model gathered.",
    )
    stage3_max_reuse_distance: int | Literal["auto"] = Field(
        "auto",
        description="Stage 3: keep a gathered parameter if it is reused within this many elements. auto: one "
        "decoder layer, so a layer is not held from its forward to its backward.",
    )
    sub_group_size: int | Literal["auto"] = Field(
        "auto",
        description="Stage 3: elements of the rank's partition stepped at a time. Each step makes a float32 copy "
        "of a sub-group's gradients and the optimizer's temporaries beside it. auto: one decoder layer; "
        "DeepSpeed's 1e9 makes the whole partition one sub-group, so both are as large as the partition.",
    )
    hpz_partition_size: int = Field(
        0,
        ge=0,
        le=1024,
        description="ZeRO++ hpZ secondary weight partition (ranks). 0: processes per machine "
        "on a multi-machine run, off (1) on one machine. Must divide the world size.",
    )
    quantized_weights: bool | None = Field(
        None,
        description="ZeRO++ qwZ (int8 weight all-gather). null: on for CUDA float16/float32 runs, off with "
        "bfloat16 (its dequantized weights come back as float16) and on CPU (no CUDA quantizer kernels).",
    )
    quantized_gradients: bool | None = Field(
        None, description="ZeRO++ qgZ (int4 gradient reduce-scatter). null: on for CUDA runs, off on CPU."
    )
    shard_head: bool = Field(
        True,
        description="Stage 3 LoRA: keep the frozen input embedding and output head out of ZeRO's partitioning, "
        "each rank holding its own rows of the vocabulary: it looks them up, and computes the logits over them, "
        "for every rank's tokens (vocabulary-parallel, as fsdp2.shard_head), so neither is ever gathered whole. "
        "Applies to untied ends that LoRA leaves frozen (not in modules_to_save), without offload_param. "
        "false: both are ZeRO-3 parameters, gathered for their forward and backward.",
    )


class ZeRO(Strategy):
    """DeepSpeed ZeRO at a fixed stage."""

    runtime = "ladle.train.runtime.deepspeed:ZeRORuntime"
    """Where its worker side is (``ladle.train.runtime``): imported by the worker only."""

    engine = "deepspeed"
    options_model = DeepSpeedOptions
    options_section = "deepspeed"
    compile_note = "DeepSpeed with torch.compile is rejected (its engine hooks break under compiled graphs)"

    def __init__(self, stage: int):
        self.stage = stage
        self.name = f"zero{stage}"
        self.shortcuts = (str(stage),)
        self.shards_tensors = stage == 3
        self.compiles_blocks = stage < 3  # ZeRO-3's parameter hooks break under compiled graphs
        self.fuses_lora = stage < 3  # ZeRO-3 gathers a module's weights when that module is called
        self.whole_forward = self.plain_head = True
        self.summary = {
            1: "DeepSpeed ZeRO-1: optimizer state sharded across ranks",
            2: "DeepSpeed ZeRO-2: optimizer state and gradients sharded",
            3: "DeepSpeed ZeRO-3: parameters, gradients and optimizer state sharded",
        }[stage]

    # -- planner side (no DeepSpeed import) ---------------------------------

    def rollouts_refusal(self, options) -> str | None:
        """Stage 3 samples too: every weight is gathered whole on each rank for the step's rollouts
        (``ZeRORuntime.whole_weights``), and the plan says what that holds in GiB."""
        return None

    def heap_kept(self, job, states, gathered: int) -> int:
        """ZeRO-3 (the only stage that gathers for the rollouts): its update then gathers each layer's partitions
        into fresh blocks as it runs (forward and backward), which the raised threshold also puts on the heap:
        measured on SmolLM2 at about the whole gathered weights (bench/grpo_memory.py: 2,618-2,766 MiB against
        2,198 predicted with only the part not held; 1,467-1,499 MiB with the threshold pinned, so the part is the
        heap's)."""
        return gathered

    def offload(self, options) -> tuple[bool, bool]:
        return options.offload_optimizer != "none", options.offload_param != "none"

    def dims(self, options, world_size: int, nodes: int) -> Dims:
        # Every ZeRO stage divides model states over the data-parallel ranks (stage 1 the optimizer state,
        # 2 also gradients, 3 also weights): one sharded dimension, as accelerate's ParallelismConfig names it.
        return Dims(dp_shard=world_size)

    def candidates(self, job, interconnect, cfg) -> list[Candidate]:
        host = {"offload_optimizer": "cpu"}
        slow = f"{self.name} with optimizer offload: the optimizer step runs on the host (slow)"
        if job.world == 1:
            why = "one device too small: optimizer state and its step move to host memory"
            return [Candidate(self, 10, why, host, needs_cuda=True, warning=slow)] if self.stage == 2 else []
        if job.lora:
            why = "the frozen base does not fit whole on a device; ZeRO-3 shards it"
            return [Candidate(self, 20, why)] if self.stage == 3 else []
        if self.stage == 1:
            return [Candidate(self, 30, "optimizer state sharded: same traffic as DDP")]
        if self.stage == 2:
            return [Candidate(self, 31, "gradients sharded too: still DDP's traffic")]
        last = "last resort: optimizer state and step on the host (PCIe-bound)"
        return [
            Candidate(self, 40, "DeepSpeed's full sharding"),
            Candidate(self, 90, last, host, needs_cuda=True, warning=slow),
        ]

    def model_states(self, job, options) -> memory.ModelStates:
        s, offload = job.shape, self.offload(options)
        largest = max(s.layer_params, s.embedding_params // 2)
        if job.dtype_bytes == 4 and not any(offload):
            # float32 (CPU): the partition is its own master (``share_master``). ZeRO-1/2 hold a 4-byte replica
            # and, at the step (their peak), the float32 gradient partition they step (the replicated gradients
            # are freed as they are flattened into it) and its moments; ZeRO-3 gathers a layer at a time.
            states = memory.fp32(s.params, job.world)
            if self.stage < 3:
                return dataclasses.replace(states, weights=4 * s.params)
            return dataclasses.replace(states, gathered=8 * largest)
        if self.stage == 1:
            return memory.zero1(s.params, job.world)
        if self.stage == 2:
            return memory.zero2(s.params, job.gpus_per_node, job.nodes, offload_optimizer=offload[0])
        return memory.zero3(
            s.params, largest, job.gpus_per_node, job.nodes, offload_optimizer=any(offload), offload_params=offload[1]
        )

    def lora_base_ranks(self, job, options) -> int:
        return job.world if self.stage == 3 else 1

    def ends_gathered(self, job, options) -> bool:
        return not (self.stage == 3 and ends_stay_local(job, options))

    def step_bytes(self, job, options, states) -> int:
        """DeepSpeed steps a flat float32 partition: stages 1/2 the rank's whole partition as one tensor (torch
        AdamW's temporaries as large as it), stage 3 one sub-group at a time (sub_group_size), beside a copy of
        the sub-group's gradients (float32 in a float32 run; in 16-bit runs the float32 copy is counted in the
        states and the 16-bit flattened gradients are the transient). Offloaded, the step runs on the host."""
        if any(self.offload(options)):
            return 0
        if job.lora:
            return super().step_bytes(job, options, states)
        local = job.shape.params // job.world
        if self.stage < 3:
            return (4 if job.cuda else 8) * local
        sub = min(local, sub_group_elements(options.sub_group_size, job.shape.layer_params, job.shape.largest_tensor))
        return (8 if job.dtype_bytes == 4 else 6) * sub

    def estimate(self, job, options):
        """On a CPU host, DeepSpeed's engine adds its own memory beside the states (``ENGINE_HOST_BYTES``)."""
        est = super().estimate(job, options)
        return est if job.cuda else dataclasses.replace(est, context=est.context + ENGINE_HOST_BYTES)

    def save_bytes(self, job, options, states) -> int:
        """What rank 0 gathers at once; DeepSpeed keeps its gradient partitions allocated between steps."""
        return gathered_for_save(job)

    def load_bytes(self, job, options, states) -> int:
        """Loading, or ``deepspeed.initialize`` after it, whichever holds more.

        Loading: ZeRO-1/2 read the whole replica (in the run's dtype) a tensor at a time; ZeRO-3 loads module by
        module: the module's gathered weights, and on rank 0 the tensor read. Ends kept local are read a rank's
        rows at a time, beside their partition until it is dropped.

        Initialize builds DeepSpeed's buffers for what it steps (a full fine-tune's parameters, a LoRA run's
        trained ones) beside the loaded weights: ZeRO-1/2 flatten them into one buffer while the module's tensors
        still exist (a second copy for the moment of the copy); ZeRO-3 allocates its gradient partitions (in the
        run's dtype) and a float32 master of its partition (kept in 16-bit runs; in float32 a clone, until
        ``share_master`` drops it). Measured on the 0.38B bench model's full fine-tune, 2 float32 ranks: ZeRO-1/2
        peak at 3 026 MiB above the baseline while loading, ZeRO-3 at 2 673 (with DeepSpeed's engine)."""
        s = job.shape
        trained = s.trainable if job.lora else s.params
        if self.stage < 3:  # the replica, the tensor being read, then the flattened copy
            return states.weights + job.dtype_bytes * (s.largest_tensor + trained)
        base = super().load_bytes(job, options, states)  # the share plus the largest tensor read
        if self.ends_gathered(job, options):
            filled = base + s.largest_tensor * job.dtype_bytes
        else:
            rows = -(-s.vocab // job.world) * s.hidden
            filled = base + job.dtype_bytes * (max(2 * s.hidden * s.intermediate, 2 * rows) - s.largest_tensor)
        if any(self.offload(options)):
            return filled
        return max(filled, weights_held(job, states) + (job.dtype_bytes + 4) * trained // job.world)

    def validate(self, cfg, topo, target) -> list[str]:
        ds = cfg.parallelism.deepspeed
        problems = []
        for field in ("offload_optimizer", "offload_param"):
            value = getattr(ds, field)
            if value != "none" and topo.gpu_count == 0:
                problems.append(
                    f"parallelism.deepspeed.{field} = {value}: offloading moves state off CUDA devices and this "
                    f"host has none. Set parallelism.deepspeed.{field}=none."
                )
            if value == "nvme" and not ds.nvme_path:
                problems.append(
                    f"parallelism.deepspeed.{field} = nvme: needs a folder on fast local storage. "
                    "Set parallelism.deepspeed.nvme_path=/local/nvme."
                )
        if ds.offload_param != "none" and self.stage < 3:
            problems.append(
                f"parallelism.deepspeed.offload_param = {ds.offload_param}: parameter offload needs parameter "
                f"sharding (ZeRO-3), not {self.name}. Use --set parallelism.strategy=zero3 or offload_param=none."
            )
        return problems

    def configure(self, cfg, plan) -> tuple[dict, list[str]]:
        return render_zero(self.stage, self.name, cfg, plan)

    def before_launch(self, plan) -> None:
        validate_with_deepspeed(plan.launcher_config, plan.world_size)

    # -- worker side ---------------------------------------------------------

    native_checkpoint = True


class ZeROPlusPlus(ZeRO):
    """ZeRO-3 with quantized weight all-gather (qwZ), quantized gradients (qgZ) and hpZ."""

    runtime = "ladle.train.runtime.deepspeed:ZeROPlusPlusRuntime"
    """Where its worker side is (``ladle.train.runtime``): imported by the worker only."""

    aliases = ("zero_pp", "zeropp", "zero-pp")

    def __init__(self):
        super().__init__(3)
        self.name = "zero++"
        self.shortcuts = ()
        self.summary = "DeepSpeed ZeRO++: ZeRO-3 with int8 weight all-gather, int4 gradients, hpZ secondary shards"

    def candidates(self, job, interconnect, cfg) -> list[Candidate]:
        if job.world == 1 or job.lora or job.nodes == 1:
            return []
        why = "across machines hpZ keeps weight all-gathers inside each node and qwZ/qgZ quantize what crosses the network"
        return [Candidate(self, 10, why)]

    def model_states(self, job, options) -> memory.ModelStates:
        states = super().model_states(job, options)
        if job.nodes == 1:
            return states
        # hpZ: a secondary 16-bit copy of the weights, sharded within the node
        secondary = memory.WEIGHT_16 * job.shape.params // job.gpus_per_node
        return memory.ModelStates(
            states.weights + secondary, states.gradients, states.optimizer, states.gathered, states.host
        )

    def validate(self, cfg, topo, target) -> list[str]:
        problems = super().validate(cfg, topo, target)
        ds = cfg.parallelism.deepspeed
        for field in ("quantized_weights", "quantized_gradients"):
            if getattr(ds, field) and topo.gpu_count == 0:
                problems.append(
                    f"parallelism.deepspeed.{field} = true: ZeRO++ quantization runs DeepSpeed's CUDA quantizer "
                    f"kernels and this host has no GPU. Set parallelism.deepspeed.{field}=null (auto) or false."
                )
        if ds.quantized_weights and target.dtype == "bfloat16":  # the resolved dtype: `auto` may mean bf16
            asked = "" if cfg.training.dtype == "bfloat16" else f" ({cfg.training.dtype}: resolved to bfloat16)"
            problems.append(
                f"parallelism.deepspeed.quantized_weights = true with training.dtype = bfloat16{asked}: qwZ "
                "dequantizes weights to float16, which bf16 layers reject. Set quantized_weights=null (auto: off "
                "with bf16) or training.dtype=float16."
            )
        hpz = ds.hpz_partition_size
        if hpz > 1 and target.world_size % hpz:
            problems.append(
                f"parallelism.deepspeed.hpz_partition_size = {hpz}: must divide the world size {target.world_size}. "
                "Use the processes per machine, or 0 (auto)."
            )
        return problems

    def configure(self, cfg, plan) -> tuple[dict, list[str]]:
        return render_zeropp(*super().configure(cfg, plan), plan)


# What deepspeed.initialize adds to a CPU rank beside the model's states, measured on the 0.38B bench Llama
# (2 gloo ranks, ZeRO-3, LoRA; resident memory just before and after it): 104-114 MiB, of which 62 MiB were the
# modules it imports on first use and 52 MiB of those DeepSpeed's Muon module (its `@torch.compile` kernels:
# inductor's compiler, functorch's partitioners, networkx). `stand_in_for_muon` now skips that import, which
# leaves 58 MiB: 10 MiB of modules, ~25 MiB of the hooks and autograd Function classes ZeRO-3 makes for every
# module (peft's LoRA layers are ten modules each), and the engine's buffers. Without this term ZeRO-3's LoRA
# prediction was 0.85 of the measured (FSDP2's, which builds no engine, 0.96). On GPUs the CUDA context term
# covers it.
ENGINE_HOST_BYTES = 58 * 2**20


def ends_stay_local(job, options) -> bool:
    """Whether a stage-3 plan keeps the embedding and the head out of ZeRO's partitioning (``keep_ends_local``):
    a LoRA run's untied, frozen ends over 2 or more ranks, their parameters not offloaded."""
    frozen = job.lora and not job.qlora and not job.trained_ends
    return frozen and job.shape.untied and job.world > 1 and options.shard_head and options.offload_param == "none"


for _stage in (1, 2, 3):
    register(ZeRO(_stage))
register(ZeROPlusPlus())
