"""FSDP2: torch's ``fully_shard`` per decoder layer and at the root.

Parameters, gradients and optimizer state are sharded on dim 0 across ranks
(DTensor ``Shard(0)``); each layer's parameters are all-gathered for its
forward and backward only. ladle applies ``fully_shard`` itself in the worker
rather than handing accelerate an FSDP plugin, because accelerate silently
runs DDP instead when that plugin meets a CPU run; ``check_applied`` then
verifies that every parameter really is sharded.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ladle.section import Section
from ladle.sizing import gib, memory, usable
from ladle.strategies.base import Candidate, Strategy
from ladle.strategies.catalog import register
from ladle.strategies.mesh import Dims


class FSDP2Options(Section):
    reshard_after_forward: bool = Field(
        True, description="Free each layer's gathered parameters after its forward (less memory, one more all-gather)."
    )
    cpu_offload: bool = Field(False, description="Keep parameters and optimizer state in CPU memory (CUDA runs only).")
    replicate: int = Field(
        1,
        ge=0,
        le=1024,
        description="HSDP: replica groups (data-parallel replicate degree); parameters are "
        "sharded within each group of world/replicate ranks and gradients all-reduced across groups. 1: plain "
        "FSDP (shard over all ranks). 0: one group per machine (shard inside the node, replicate across nodes).",
    )
    shard_head: bool = Field(
        True,
        description="Never gather the input embedding or the output head: each rank looks up, and computes the "
        "logits over, its own rows for every rank's tokens (vocabulary-parallel; the ranks exchange token ids and "
        "hidden states, tokens x hidden, instead of vocab x hidden weights). false: both are FSDP units, "
        "gathered for their forward and backward. Applies to untied ends under plain FSDP (not HSDP or "
        "cpu_offload).",
    )
    gradient_sync: Literal["auto", "last_microbatch", "each_microbatch"] = Field(
        "auto",
        description="When a step accumulates (more than one micro-batch a rank), when gradients are "
        "reduce-scattered. last_microbatch: once a step, after the last micro-batch; until then each rank holds "
        "the whole model's gradients unsharded in float32 (4 bytes a parameter). each_microbatch: after every "
        "micro-batch, so gradients stay sharded, at one reduce-scatter a micro-batch (under HSDP the all-reduce "
        "across replicas still runs once a step). auto: last_microbatch where the plan fits with the unsharded "
        "gradients, else each_microbatch; the plan says which and why in GiB.",
    )
    compile: bool = Field(
        False,
        description="use_fsdp2_compile: torch.compile each decoder block in place before sharding (CUDA, "
        "torch >= 2.2, accelerate >= 0.27). FSDP2 only; DeepSpeed with torch.compile is rejected.",
    )


def vocab_stays_sharded(options: dict, replicate: int) -> bool:
    """Whether the plan keeps the embedding and the head sharded (untied ones; checked on the model itself)."""
    return options.get("shard_head", True) and replicate == 1 and not options.get("cpu_offload")


def compile_problems(topo) -> list[str]:
    """What per-block torch.compile under FSDP2 needs from the machine and the installed packages."""
    from importlib.metadata import PackageNotFoundError, version

    def at_least(package: str, wanted: tuple[int, int]) -> bool:
        try:
            parts = version(package).split("+")[0].split(".")
            return tuple(int(p) for p in parts[:2] if p.isdigit()) >= wanted
        except PackageNotFoundError:
            return False

    problems = []
    if topo.gpu_count == 0:
        problems.append(
            "parallelism.fsdp2.compile = true: per-block torch.compile is supported on CUDA only and this "
            "host has no GPU. Set parallelism.fsdp2.compile=false."
        )
    for package, wanted in (("torch", (2, 2)), ("accelerate", (0, 27))):
        if not at_least(package, wanted):
            problems.append(
                f"parallelism.fsdp2.compile = true: needs {package} >= {'.'.join(map(str, wanted))}. "
                f"Upgrade {package} or set parallelism.fsdp2.compile=false."
            )
    return problems


def microbatches_per_rank(job) -> int:
    """Micro-batches each rank runs a step (``job.microbatches`` counts every rank's)."""
    return job.microbatches // max(job.world, 1)


def replicas(plan) -> int:
    """HSDP replica groups for this plan (1: plain FSDP)."""
    replicate = plan.strategy_options.get("replicate", 1)
    return plan.num_machines if replicate == 0 else replicate


FAST_LINKS = ("nvswitch",)  # interconnects on which all-gathers are cheap


class FSDP2(Strategy):
    runtime = "ladle.train.runtime.fsdp2:FSDP2Runtime"
    """Where its worker side is (``ladle.train.runtime``): imported by the worker only."""
    name = "fsdp2"
    compiles_blocks = compiles_in_wrap = whole_forward = fuses_lora = True
    summary = "fully sharded data parallel (fully_shard): parameters, gradients and optimizer state sharded"
    options_model = FSDP2Options
    options_section = "fsdp2"
    shards_tensors = True

    def compile_asked(self, options) -> str | None:
        return "parallelism.fsdp2.compile = true" if options is not None and options.compile else None

    def rollouts_refusal(self, options) -> str | None:
        """FSDP2 samples too: every FSDP unit is unsharded on each rank for the step's rollouts and kept so while
        the engine's forwards run (``FSDP2Runtime.whole_weights``); the plan says what that holds in GiB. Not with
        CPU offload (the unsharded weights would be on the host)."""
        if options is not None and options.cpu_offload:
            return "with parallelism.fsdp2.cpu_offload the weights the engine would sample on stay in host memory"
        return None

    def offload(self, options) -> tuple[bool, bool]:
        return options.cpu_offload, options.cpu_offload  # CPUOffloadPolicy moves parameters and optimizer state

    def dims(self, options, world_size: int, nodes: int) -> Dims:
        replicate = nodes if options.replicate == 0 else options.replicate
        if replicate < 1 or world_size % replicate:
            replicate = 1  # validate() reports a replicate that does not divide the world
        return Dims(dp_replicate=replicate, dp_shard=world_size // replicate)

    def label(self, options) -> str:
        hsdp = "+hsdp" if options.replicate != 1 else ""
        return self.name + hsdp + ("+offload" if options.cpu_offload else "")

    def candidates(self, job, interconnect, cfg) -> list[Candidate]:
        if job.world == 1:
            return []
        if job.lora:
            return [Candidate(self, 10, "the frozen base does not fit whole on a device; FSDP2 shards it")]
        out = []
        if job.nodes > 1:
            why = "HSDP: parameters sharded inside each machine, so only one gradient all-reduce per step crosses the network"
            out.append(Candidate(self, 15, why, {"replicate": 0}))
        if interconnect in FAST_LINKS:
            why = f"{interconnect}: all-gathers are cheap, so full sharding costs little and frees the most memory"
            return [*out, Candidate(self, 20, why)]
        why = f"{interconnect}: full sharding's extra all-gather is costly here, so it comes after ZeRO-1/2"
        return [*out, Candidate(self, 35, why)]

    def ends_gathered(self, job, options) -> bool:
        return not (job.shape.untied and job.world > 1 and vocab_stays_sharded(options.model_dump(), options.replicate))

    def model_states(self, job, options) -> memory.ModelStates:
        s, hsdp, offload = job.shape, options.replicate != 1, options.cpu_offload
        ends = self.ends_gathered(job, options)  # false: only decoder layers are ever gathered
        largest = max(s.layer_params, s.embedding_params // 2) if ends else s.layer_params
        accumulated = self.accumulated_gradients(job) if options.gradient_sync == "last_microbatch" else 0
        if job.dtype_bytes == 4:  # float32 (CPU): the shards, one unit gathered with its gradient, the ends
            ranks = job.gpus_per_node if hsdp else job.world
            states = memory.fp32(s.params, ranks)
            gathered = 8 * largest + (4 * s.embedding_params if ends else 0)
            # Accumulating unsharded, the last micro-batch's backward makes the shards beside them (as on CUDA
            # below): measured on SmolLM2's GRPO, counting them in place of the shard missed 10 % of the peak.
            gradients = states.gradients + accumulated
            return memory.ModelStates(states.weights, gradients, states.optimizer, gathered)
        states = memory.zero3(
            s.params,
            largest,
            job.gpus_per_node,
            1 if hsdp else job.nodes,
            offload_optimizer=offload,
            offload_params=offload,
        )
        # Gathered, the embedding and the head are the largest units beside the layers.
        root = memory.WEIGHT_16 * s.embedding_params if ends else 0
        return memory.ModelStates(
            states.weights, states.gradients + accumulated, states.optimizer, states.gathered + root, states.host
        )

    @staticmethod
    def accumulated_gradients(job) -> int:
        """A full fine-tune that accumulates (more than one micro-batch a rank per step) with ``gradient_sync:
        last_microbatch``: the micro-batches before the last run under ``set_requires_gradient_sync(False)``, and
        FSDP2 then keeps each unit's gradient unsharded, in the reduce dtype (float32), until the last one's
        backward reduce-scatters it. So a rank holds the whole model's float32 gradients through the step (measured
        on SmolLM2's GRPO on a CPU: the peak in the last micro-batch's backward, bench/RESULTS.md). 0 without
        accumulation."""
        return 4 * job.shape.params if microbatches_per_rank(job) > 1 and not job.lora else 0

    def settle_options(self, job, options, capacity, lora: bool, per_rank: int) -> tuple[dict, tuple[str, ...]]:
        """``gradient_sync: auto`` made explicit once the batch layout is known: one reduce-scatter a step where
        the plan fits with the whole model's unsharded float32 gradients on every rank, else one a micro-batch
        (the gradients stay sharded: torchtitan's way, the one FSDP2's authors advise where memory is short). The
        reason says which, in GiB. ``job`` None: the model size is unknown."""
        if options.gradient_sync != "auto":
            return {}, ()
        each = {"gradient_sync": "each_microbatch"}
        if lora or per_rank <= 1:  # nothing large is ever held back
            return {"gradient_sync": "last_microbatch"}, ()
        if job is None or capacity is None:
            return each, (
                f"fsdp2 gradient sync: each of {per_rank} micro-batches a rank (auto; the model size or device "
                "memory is unknown, so gradients stay sharded rather than be held unsharded through the step)",
            )
        deferred = self.estimate(job, options.model_copy(update={"gradient_sync": "last_microbatch"}))
        whole = gib(self.accumulated_gradients(job))
        limit = f"{usable(capacity)} a rank"
        if deferred.fits(capacity):
            return {"gradient_sync": "last_microbatch"}, (
                f"fsdp2 gradient sync: once a step, after the last of {per_rank} micro-batches a rank (auto): the "
                f"unsharded float32 gradients ({whole} a rank) fit, {gib(deferred.total)} within {limit}",
            )
        sharded = self.estimate(job, options.model_copy(update=each))
        hsdp = "; across replicas the all-reduce still runs once a step" if options.replicate != 1 else ""
        return each, (
            f"fsdp2 gradient sync: each of {per_rank} micro-batches a rank (auto): holding the gradients unsharded "
            f"until the last ({whole} a rank) would need {gib(deferred.total)}, more than {limit}; reduce-scattered "
            f"each micro-batch they stay sharded ({gib(sharded.total)}), at {per_rank}x the reduce-scatter "
            f"traffic{hsdp}",
        )

    def load_bytes(self, job, options, states) -> int:
        """Loading fills each rank's rows from the safetensors (``Pending.fill`` reads a slice at a time), so
        beside its share a rank holds its rows of the tensor being read, not the whole tensor (QLoRA loads
        whole, quantizing on the way)."""
        if job.qlora:
            return super().load_bytes(job, options, states)
        weights = states.weights or job.dtype_bytes * job.shape.params // max(1, job.world)
        return weights + job.shape.largest_tensor * job.dtype_bytes // self.lora_base_ranks(job, options)

    def lora_base_ranks(self, job, options) -> int:
        return job.gpus_per_node if options.replicate != 1 else job.world

    def validate_unused(self, cfg, chosen) -> list[str]:
        if not cfg.parallelism.fsdp2.compile or chosen is self:
            return []
        what = chosen.compile_note or f"compile is wired for fsdp2 only, not {chosen.name}"
        return [
            f"parallelism.fsdp2.compile = true with parallelism.strategy = {chosen.name}: {what}. "
            "Set parallelism.strategy=fsdp2 or parallelism.fsdp2.compile=false."
        ]

    def validate(self, cfg, topo, target) -> list[str]:
        problems = []
        replicate, world_size = cfg.parallelism.fsdp2.replicate, target.world_size
        if replicate > 1 and (replicate > world_size or world_size % replicate):
            problems.append(
                f"parallelism.fsdp2.replicate = {replicate}: must divide the world size {world_size} "
                "(replicate x shard = world). Use a divisor, 0 (one group per machine) or 1 (plain FSDP)."
            )
        if cfg.parallelism.fsdp2.compile:
            problems += compile_problems(topo)
        if cfg.parallelism.fsdp2.cpu_offload and topo.gpu_count == 0:
            problems.append(
                "parallelism.fsdp2.cpu_offload = true: offloading to CPU needs CUDA devices to offload from; "
                "this host has none. Set parallelism.fsdp2.cpu_offload=false."
            )
        return problems

    def configure(self, cfg, plan) -> tuple[dict, list[str]]:
        opts, replicate = plan.strategy_options, replicas(plan)
        shard = plan.world_size // max(replicate, 1)
        config = {
            "mesh": {"replicate": replicate, "shard": shard} if replicate > 1 else {"shard": plan.world_size},
            "reshard_after_forward": opts["reshard_after_forward"],
            "mixed_precision": {
                "param_dtype": plan.dtype if plan.device == "cuda" else "float32",
                "reduce_dtype": "float32",
            },
            "cpu_offload": opts["cpu_offload"],
            "gradient_sync": opts.get("gradient_sync", "last_microbatch"),
            "compile": bool(plan.kernels.get("compile", opts["compile"])),
            "units": "each *DecoderLayer, the input embedding, the output head, then the root",
            "vocabulary": "sharded: vocabulary-parallel embedding and loss"
            if vocab_stays_sharded(opts, replicate)
            else "gathered: the embedding and the head are FSDP units",
        }
        reasons = []
        if replicate > 1:
            reasons.append(
                f"fsdp2 HSDP mesh {replicate} x {shard}: parameters sharded over {shard} ranks, "
                f"replicated {replicate} times; gradients all-reduced across replicas"
            )
        return config, reasons


register(FSDP2())
