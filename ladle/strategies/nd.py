"""N-D parallelism: ``pp × dp_replicate × dp_shard × cp × sp × tp`` composed on one device mesh.

The degrees come from ``parallelism.dims`` (or from the planner, which sizes
N-D candidates like any other). The worker builds one ``DeviceMesh`` from them
(``ladle.strategies.mesh``) and applies each parallelism on its own dimension,
in torchtitan's fixed order:

1. **pp** — the decoder is split into stages first (``StageModule``: this
   rank's layers, the embedding on the first stage, norm and head on the last);
   the schedule (1F1B or GPipe) runs over the ``pp`` dimension's group.
2. **tp** — each decoder layer's projections are split with torch's tensor
   parallel API on the ``tp`` dimension: q/k/v and gate/up by output rows
   (``ColwiseParallel``), o and down by input columns (``RowwiseParallel``), so a
   rank holds whole attention heads and a slice of the MLP, and one all-reduce
   per block rebuilds the activations. The embedding, norms and head stay whole
   on each tp rank (sharded by FSDP below when dp_shard > 1).
3. activation checkpointing (``training.gradient_checkpointing``, applied by the
   worker before wrapping, as for every strategy).
4. **dp_replicate × dp_shard** — FSDP2 ``fully_shard`` per decoder layer, the
   embedding and head as units of their own, then the root, on the
   ``(dp_replicate, dp_shard)`` sub-mesh (HSDP when both are above 1). Weights
   already split by tp are sharded again on dim 0 (DTensor ``_StridedShard``).
   With ``sp`` the shard dimension is ``dp_shard × sp`` (ZeRO-3's layout: the
   ranks that split a sequence also split the weights).
5. **sp** — Ulysses sequence parallelism (``ladle.train.sequence_parallel``):
   each rank of an sp group holds ``seq_len / sp`` tokens of every row, labels
   shifted before the split; per attention layer one all-to-all trades the
   sequence split for a head split, attention runs over whole sequences (packed
   rows kept apart by their position ids) on ``heads / sp`` heads, and a second
   all-to-all trades back. sp composes with dp_replicate and dp_shard; with pp,
   tp and cp it is refused (not wired).

Each rank then reads only its region of every tensor from the safetensors
(``ladle.train.loading``), and ``check_applied`` verifies the placement of every
parameter on every mesh dimension.

Not composed here, each refused with its reason by the planner: LoRA with tp > 1
(peft's adapter adds a full-width product to a projection's local, sharded
output), cp > 1 (ring context parallelism: torch's ring attention dispatches CUDA kernels only, so on CPU it cannot
run; on GPUs it needs unpacked rows and pre-shifted labels, not wired yet: Ulysses ``sp`` is what runs), QLoRA (bitsandbytes' 4-bit
weights are not DTensors) and per-block compile.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Literal

from pydantic import Field

from ladle import sizing
from ladle.section import Section
from ladle.sizing import memory
from ladle.strategies.base import Candidate, Strategy
from ladle.strategies.catalog import register
from ladle.strategies.mesh import ORDER, Dims, model_problems, resolve

Degree = Literal["auto"] | Annotated[int, Field(ge=1, le=1024)]

FAST_LINKS = ("nvswitch", "partial-nvlink")  # where tensor parallelism's per-block all-reduces are affordable
MIN_SLICE = 1024  # columns of a projection each tp rank keeps, at least (hidden // tp)
CP_ON_CPU = (
    "parallelism.dims.cp = {cp}: context parallelism runs ring attention through torch's context_parallel, whose "
    "attention kernels are CUDA's only (flash, memory-efficient, cuDNN SDPA); this host has no GPU. Set "
    "parallelism.dims.cp=1; to split long sequences across ranks here, set parallelism.dims.sp (Ulysses: "
    "all-to-all, which gloo runs)."
)
CP_NOT_WIRED = (
    "parallelism.dims.cp = {cp}: context parallelism is not wired in this version: ring attention needs "
    "unpacked rows with pre-shifted labels and FSDP over dp_shard × cp, and no multi-GPU machine has verified "
    "it. Set parallelism.dims.cp=1; to split long sequences across ranks, set parallelism.dims.sp (Ulysses "
    "sequence parallelism, which runs)."
)


SP_ALONE = {
    "pp": "the pipeline's stages exchange whole rows of activations between ranks",
    "tp": "tensor parallelism splits the heads the all-to-all exchanges a second time",
    "cp": "ring attention splits the same sequence another way",
}
"""The degrees sp does not compose with in this version, and why."""


def sp_composition_problems(asked: Dims) -> list[str]:
    """sp composes with dp_replicate and dp_shard; every other degree above 1 is refused with its reason."""
    return [
        f"parallelism.dims.sp = {asked.sp} with {name} = {getattr(asked, name)}: not composed in this version "
        f"({why}). Set parallelism.dims.{name}=1, or sp=1."
        for name, why in SP_ALONE.items()
        if getattr(asked, name) > 1
    ]


class DimsOptions(Section):
    pp: Degree = Field("auto", description="Pipeline stages (outermost dimension). auto: 1.")
    dp_replicate: Degree = Field(
        "auto",
        description="Replica groups: gradients all-reduced across them. auto: 1, or the ranks left when "
        "dp_shard is set.",
    )
    dp_shard: Degree = Field(
        "auto", description="FSDP degree: parameters, gradients and optimizer state sharded. auto: the ranks left."
    )
    cp: Degree = Field(
        "auto",
        description="Ring context parallel degree (torch's context_parallel; CUDA only, not wired in this version: "
        "use sp). auto: 1.",
    )
    sp: Degree = Field(
        "auto",
        description="Ulysses sequence parallel degree: each row split into sp slices across ranks, attention heads "
        "exchanged by all-to-all. It must divide the attention heads and data.seq_len; composes with dp_replicate "
        "and dp_shard (FSDP shards over dp_shard × sp). auto: 1.",
    )
    tp: Degree = Field(
        "auto",
        description="Tensor parallel degree (innermost: consecutive ranks, one machine's fast links). It must "
        "divide the attention and KV heads. auto: 1.",
    )
    schedule: Literal["1f1b", "gpipe"] = Field("1f1b", description="Pipeline schedule when pp > 1.")

    def asked(self) -> dict[str, int | str]:
        return {name: getattr(self, name) for name in ORDER}

    def is_set(self) -> bool:
        return any(value != "auto" for value in self.asked().values())


def degrees(options: DimsOptions, world: int) -> Dims:
    """The resolved degrees (all dp_shard when the asked ones do not resolve: ``validate`` reports why)."""
    dims, _ = resolve(options.asked(), world)
    return dims or Dims(dp_shard=world)


def asked_dims(options: DimsOptions) -> Dims:
    """The degrees set explicitly (``auto`` as 1): what the model and feature checks judge when the product
    itself is wrong, so every problem is reported in one go."""
    return Dims.of({name: value for name, value in options.asked().items() if value != "auto"})


def tp_degrees(heads: int, kv_heads: int, per_node: int) -> list[int]:
    """Tensor-parallel degrees inside one machine that divide the attention and KV heads, largest first."""
    return [d for d in range(per_node, 1, -1) if not per_node % d and not kv_heads % d and not heads % d]


class ND(Strategy):
    runtime = "ladle.train.runtime.nd:NDRuntime"
    """Where its worker side is (``ladle.train.runtime``): imported by the worker only."""
    name = "nd"
    summary = "N-D parallel on one device mesh: pp × dp_replicate × dp_shard × cp × tp, from parallelism.dims"
    options_model = DimsOptions
    options_section = "dims"
    shards_tensors = True
    compile_note = "per-block compile is wired for fsdp2 only"

    # -- planner side --------------------------------------------------------

    def dims(self, options, world_size: int, nodes: int) -> Dims:
        return degrees(options, world_size)

    def asked_for(self, cfg) -> bool:
        return cfg.parallelism.dims.is_set()

    def label(self, options) -> str:
        """``nd(tp=2 × dp_shard=2)``: the degrees asked for (the plan's mesh shows the resolved ones)."""
        if not options.is_set():
            return self.name
        return f"{self.name}({asked_dims(options).describe()})"

    def data_parallel_degree(self, world_size: int, options) -> int:
        return degrees(options, world_size).dp

    def default_accumulation(self, options) -> int:
        return options.pp if options.pp != "auto" else 1  # one microbatch per stage fills the pipeline

    def validate(self, cfg, topo, target) -> list[str]:
        """The degrees' product, and what each asked degree allows, all reported at once."""
        options = cfg.parallelism.dims
        _, problems = resolve(options.asked(), target.world_size)
        if target.world_size < 2:
            problems.append(
                "parallelism.strategy = nd: a mesh of degrees needs at least 2 processes and this plan has 1. "
                "Use parallelism.strategy=ddp for one process, or more processes (--gpus N, parallelism.cpu_processes)."
            )
        asked = asked_dims(options)
        if asked.cp > 1:
            problems.append((CP_ON_CPU if topo.gpu_count == 0 else CP_NOT_WIRED).format(cp=asked.cp))
        if asked.sp > 1:
            problems += sp_composition_problems(asked)
        if asked.tp > 1 and cfg.training.lora.enabled:
            problems.append(
                f"parallelism.dims.tp = {asked.tp} with training.lora.enabled = true: peft's LoRA layer adds its "
                "full-width product to the base projection's output, which tensor parallelism leaves sharded on "
                "each rank. Set training.lora.enabled=false (full fine-tune) or parallelism.dims.tp=1."
            )
        if cfg.training.quantization.mode != "none":
            problems.append(
                f"training.quantization.mode = {cfg.training.quantization.mode} with parallelism.strategy = nd: "
                "bitsandbytes' 4-bit weights cannot be split or sharded on a mesh. Use parallelism.strategy=fsdp2 "
                "for QLoRA."
            )
        return problems

    def validate_model(self, cfg, model: dict, world_size: int) -> list[str]:
        dims, _ = resolve(cfg.parallelism.dims.asked(), world_size)
        return model_problems(dims or asked_dims(cfg.parallelism.dims), model, cfg.data.seq_len)

    def validate_batch(self, options, micro: int, accumulation: int, global_batch: int) -> list[str]:
        pp = options.pp if options.pp != "auto" else 1
        if pp < 2 or options.schedule != "1f1b" or accumulation >= pp:
            return []
        return [
            f"training.global_batch_size = {global_batch}: 1f1b needs at least one microbatch per stage "
            f"({accumulation} < pp = {pp}). Raise training.global_batch_size or set parallelism.dims.schedule=gpipe."
        ]

    def validate_unused(self, cfg, chosen) -> list[str]:
        options = cfg.parallelism.dims
        if chosen is self or not options.is_set():
            return []
        shown = ", ".join(f"{k}={v}" for k, v in options.asked().items() if v != "auto")
        return [
            f"parallelism.dims ({shown}) with parallelism.strategy = {chosen.name}: a named strategy runs its own "
            "preset degrees. Set parallelism.strategy=nd (or auto) to compose them, or remove parallelism.dims."
        ]

    def candidates(self, job, interconnect, cfg) -> list[Candidate]:
        """tp inside each machine's fast links × dp_shard across the rest, for CUDA full fine-tunes (LoRA and tp
        do not compose; on CPU tp's all-reduces are pure cost).

        Ranked by the weight traffic that crosses machines per step, in units of the model's weights per rank:
        ZeRO-3 moves 3 (all-gather forward and backward, reduce-scatter), ZeRO++ ~0.75 (int8 gathers, hpZ keeps
        the backward gather in the node, int4 gradients); dp_shard over tp slices moves 3/tp at full precision:
        0.375 at tp=8, half of ZeRO++'s, so it ranks before it; tp=4 equals ZeRO++'s and ranks after it (tp's
        all-reduces are extra); tp=2 after HSDP. A degree is offered only where each rank keeps at least
        ``MIN_SLICE`` columns of a projection (smaller GEMMs waste the GPU). On one machine tp only trades
        all-reduces for memory (activations divided by tp), so it comes after fsdp2. With several machines,
        ``pp`` = machines × tp inside is offered too, for when a machine cannot hold its share even so.
        """
        s = job.shape
        split = self.sp_candidates(job)
        if not job.cuda or job.lora or job.world < 4 or job.gpus_per_node < 2 or interconnect not in FAST_LINKS:
            return split
        out = []
        kv_heads = s.kv_dim // max(1, s.hidden // s.heads)
        degrees = [tp for tp in tp_degrees(s.heads, kv_heads, job.gpus_per_node) if s.hidden // tp >= MIN_SLICE]
        for tp in degrees if job.nodes > 1 else degrees[:1]:  # one machine: only the most memory it can free
            dp_shard = job.world // tp
            crossing = f"{3 / tp:.3g}" if job.nodes > 1 else None
            rank = {8: 9, 4: 11}.get(tp, 16) if job.nodes > 1 else 30
            where = f"inside each machine's {interconnect}"
            why = (
                f"tp={tp} {where} (its per-block all-reduces stay on the fastest links) × dp_shard={dp_shard}: "
                f"weights, gradients and optimizer state divided over all {job.world} ranks"
                + (
                    f"; {crossing} of the weights cross machines per step (ZeRO-3: 3, ZeRO++: ~0.75 quantized)"
                    if crossing
                    else "; one machine: tp divides activations at the cost of per-block all-reduces"
                )
            )
            out.append(Candidate(self, rank, why, Dims(tp=tp, dp_shard=dp_shard).degrees()))
        if job.nodes > 1 and s.layers >= job.nodes and out:
            tp = out[0].options["tp"]
            why = (
                f"pp={job.nodes}: one stage per machine, only activations cross the network; tp={tp} × "
                f"dp_shard={job.gpus_per_node // tp} inside each machine"
            )
            out.append(Candidate(self, 40, why, Dims(pp=job.nodes, tp=tp, dp_shard=job.gpus_per_node // tp).degrees()))
        return out + split

    def sp_candidates(self, job) -> list[Candidate]:
        """Ulysses sequence parallelism inside one machine, for when a sequence's activations do not fit one
        rank: sp = 2, 4, ... (dividing the heads, the row length and the machine's ranks), each with FSDP over
        every rank (dp_shard × sp). Ranked after every other layout: splitting a sequence costs two all-to-alls
        per attention layer, so the planner turns activation checkpointing on first (``choose_checkpointing``
        tries the others with recomputation before these), and takes the smallest sp that fits."""
        from ladle.strategies.mesh import sequence_parallel_problems

        out = []
        for sp in (2, 4, 8, 16, 32):
            if sp > job.gpus_per_node or job.gpus_per_node % sp or job.world % sp:
                break
            if sequence_parallel_problems(sp, job.shape.heads, job.seq_len, job.attention):
                continue
            tokens = job.micro_batch * job.seq_len
            why = (
                f"sp={sp} (Ulysses) × dp_shard={job.world // sp}: each rank holds {tokens // sp} of a micro-batch's "
                f"{tokens} tokens; two all-to-alls per attention layer inside the machine"
            )
            options = Dims(dp_shard=job.world // sp, sp=sp).degrees()
            out.append(Candidate(self, 80 + sp, why, options, splits_sequence=True))
        return out

    def model_states(self, job, options) -> memory.ModelStates:
        """Weights, gradients and optimizer state of the fullest rank. tp splits the decoder layers only: the
        embedding and head stay whole on each tp rank (divided by dp_shard alone), and with pp they sit on the
        first and last stage. Across dp_shard the root units (embedding, head) are gathered whole, and the largest
        unit (a layer's tp slice, or one end) with its gradient, as FSDP2 counts its gathered ends. With dp_replicate
        alone (dp_shard = 1) FSDP2 still copies each unit into its all-gather buffer and its gradient into the
        reduce buffer: the largest unit's weight and gradient once more (bench/nd.py's pp=2 x dp_replicate=2 was
        117 MiB above the prediction without it, two float32 copies of its 16.4M-element head)."""
        dims, s = degrees(options, job.world), job.shape
        shard = dims.fsdp_shard  # dp_shard × sp
        layers = s.layer_params * s.layers // dims.pp  # a stage's decoder weights
        root = s.embedding_params // (2 if dims.pp > 1 else 1)  # the embedding or the head on an end stage
        held = layers // (dims.tp * shard) + root // shard  # this rank's parameters
        largest = max(s.layer_params // dims.tp, s.embedding_params // 2)
        sharded, wrapped = shard > 1, dims.dp * dims.sp > 1  # FSDP2 wraps the units over the data-parallel mesh
        if job.dtype_bytes == 4:  # float32 (CPU): 4-byte weights and gradients, AdamW's two moments
            states = memory.fp32(held)
            extra = 8 * largest * wrapped + 4 * root * sharded
            return memory.ModelStates(states.weights, states.gradients, states.optimizer, extra)
        states = memory.zero3(held * shard, largest, shard, 1)
        extra = states.gathered * wrapped + memory.WEIGHT_16 * root * sharded
        return memory.ModelStates(states.weights, states.gradients, states.optimizer, extra)

    def lora_base_ranks(self, job, options) -> int:
        return degrees(options, job.world).shards

    def activations(self, job, options) -> tuple[int, str]:
        """A stage's layers; tp divides what each block computes inside (q/k/v, heads, the MLP's width), not the
        residual stream each rank keeps whole; with pp, up to ``pp`` microbatches are in flight on stage 0."""
        dims, s = degrees(options, job.world), job.shape
        split = dataclasses.replace(
            s, intermediate=s.intermediate // dims.tp, kv_dim=s.kv_dim // dims.tp, heads=max(1, s.heads // dims.tp)
        )
        layers = -(-s.layers // dims.pp)
        in_flight = min(job.microbatches, dims.pp) if dims.pp > 1 else 1
        tokens = job.micro_batch * job.seq_len // (dims.cp * dims.sp)
        acts = in_flight * sizing.activation_bytes(split, tokens, layers, job.dtype_bytes, job.checkpointing)
        note = f"mesh {dims.describe()}: {layers} layers per stage, {in_flight} microbatch(es) in flight"
        if dims.sp > 1:
            acts += sizing.all_to_all_bytes(s, tokens, job.dtype_bytes, dims.sp)
            note += f"; sp={dims.sp}: {tokens} tokens per rank, one layer's all-to-all buffers"
        return acts, note

    def runs_whole_forward(self, options) -> bool:
        """With sp (which runs alone with data parallelism) each rank runs the whole model on its slices; with pp
        a rank runs a stage, and tp is not checked with the fused loss."""
        return options.sp not in ("auto", 1)

    def pairs_refusal(self, options) -> str | None:
        if self.runs_whole_forward(options):  # sp: each rank holds a slice of every row
            return (
                "sequence parallelism splits every row over the sp ranks, so a side's log-probability would be a "
                "sum across ranks that the pair loss does not make; train pairs without sp (fsdp2 or zero3)"
            )
        return "N-D stages (pp, tp) do not run the model's whole forward on each rank; train pairs with fsdp2 or zero3"

    def logits_bytes(self, job, options) -> int:
        """A rank's logits are its slice's: ``seq_len / sp`` tokens of each row."""
        sp = degrees(options, job.world).sp
        return super().logits_bytes(dataclasses.replace(job, seq_len=job.seq_len // sp), options)

    def configure(self, cfg, plan) -> tuple[dict, list[str]]:
        dims = Dims.of(plan.mesh)
        config = {
            "mesh": dims.degrees(),
            "order": "pp stages split -> tp (colwise q/k/v/gate/up, rowwise o/down) -> activation checkpointing "
            "-> FSDP2 on (dp_replicate, dp_shard × sp)"
            + (" -> Ulysses all-to-all attention on sp" if dims.sp > 1 else ""),
            "schedule": plan.strategy_options["schedule"] if dims.pp > 1 else None,
            "fsdp_mesh": [dims.dp_replicate, dims.fsdp_shard] if dims.dp * dims.sp > 1 else None,
        }
        reasons = [
            f"mesh {dims.describe()}: {dims.dp} data-parallel replica(s) read different rows; each holds "
            f"1/{dims.shards} of the weights"
        ]
        if dims.sp > 1:
            reasons.append(
                f"sp={dims.sp}: every row split into {dims.sp} slices of {cfg.data.seq_len // dims.sp} tokens "
                "(labels shifted before the split); per attention layer an all-to-all gives each rank the whole "
                f"sequence over 1/{dims.sp} of the heads, and another gives back its slice (Ulysses; ring context "
                "parallelism is not what runs)"
            )
        return config, reasons

    # -- worker side ---------------------------------------------------------

    mesh = None
    """The run's ``DeviceMesh``, set by ``wrap`` (a worker process trains one model)."""

    def eval_micro_batch(self, job, options) -> tuple[int, str]:
        if self.dims(options, job.world, job.nodes).pp > 1:
            return job.micro_batch, "the training micro-batch: the pipeline stages' shapes are fixed"
        return super().eval_micro_batch(job, options)

    native_checkpoint = True


register(ND())
