"""The strategy interface, deciding side: everything the planner knows about one strategy.

A strategy is one small class (no torch import, no process or GPU touched): it
names itself, validates itself against the machine, sizes its per-rank memory,
ranks itself for an interconnect and node count, says which fast paths it allows
(traits: ``compiles_blocks``, ``whole_forward``, ``plain_head`` ...) and renders
its launcher config. Its applying side, what a training process does with the
model (wrap, step, gather, save and load), is a ``Runtime`` in
``ladle.train.runtime`` that the class names in ``runtime``; only the worker
imports it. Adding a strategy is adding the two classes and registering the
first in ``ladle.strategies``: the config's strategy type, the CLI's choices
and the docs come from the registry.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ladle import sizing
from ladle.sizing import memory
from ladle.strategies.mesh import Dims

if TYPE_CHECKING:
    from ladle.machine.topology import Topology
    from ladle.section import Section

# A strategy reads the run's config and plan, yet neither module is imported here, not even for type checking:
# both are built from the strategies (the config's parallelism sections and strategy choices, the plan's strategy
# and its options), so importing them would close a circle. These names say what the annotations mean.
LadleConfig = Any  # ladle.config.LadleConfig
Plan = Any  # ladle.plan.model.Plan

EVAL_MICRO_MAX = 8  # an eval forward takes at most 8 training micro-batches' rows


@dataclass(frozen=True)
class Target:
    """What the planner settled before the strategy's checks: device, processes and dtype."""

    device: str
    processes_per_machine: int
    nodes: int
    dtype: str

    @property
    def world_size(self) -> int:
        return self.processes_per_machine * self.nodes


@dataclass(frozen=True)
class Candidate:
    """One way to run a strategy that the sizing weighs.

    ``rank`` orders candidates fastest first for this machine (lower is faster); ``options`` are the
    option values this variant sets over the config's (e.g. optimizer offload); ``why`` is its place;
    ``needs_cuda`` drops it on CPU hosts; ``reason`` and ``warning`` are added to the plan when it is chosen.
    """

    strategy: Strategy
    rank: int
    why: str
    options: dict[str, Any] = field(default_factory=dict)
    needs_cuda: bool = False
    reason: str | None = None
    warning: str | None = None
    splits_sequence: bool = False
    """It splits each sequence across ranks (sequence parallelism): weighed only after recomputing activations
    is (``ladle.plan.memory.choose_checkpointing``)."""


class Strategy(ABC):
    runtime: str = ""
    """Its worker side, ``"module:Class"`` of a ``ladle.train.runtime.base.Runtime`` subclass: only the worker
    imports it (``runtime_for``). Empty: the strategy can be planned but not run."""
    name: str
    summary: str
    aliases: tuple[str, ...] = ()
    """Other names the config and the CLI accept for this strategy."""
    engine: str = "torch"
    """The library that runs it; the CLI's ``--deepspeed NAME`` flag offers the ``deepspeed`` ones."""
    shortcuts: tuple[str, ...] = ()
    """Names accepted by the engine's CLI flag only (``--deepspeed 3``): ambiguous in a config."""
    options_model: type[Section] | None = None
    """Its options, the config section ``parallelism.<options_section>`` (None: it has none)."""
    options_section: str | None = None
    shards_tensors: bool = False
    """Parameters are flat-sharded float tensors (FSDP2, ZeRO-3): a 4-bit base must be stored in a float dtype."""
    compile_note: str | None = None
    """Why ``torch.compile`` cannot run with this strategy (None: the generic reason)."""
    fallback: bool = False
    """The strategy used when the job cannot be sized (exactly one registered strategy sets it)."""
    compiles_blocks: bool = False
    """Per-block ``torch.compile`` runs with it (ZeRO-3's parameter hooks and pipeline or tensor-parallel stages
    break under compiled graphs or have not been checked with them)."""
    compiles_in_wrap: bool = False
    """It compiles the blocks itself while wrapping (FSDP2, before sharding), not the worker."""
    whole_forward: bool = False
    """Its step calls the model's own forward with the head inside it, so the fused loss (replacing the head's
    forward), padding-free rows and attention example by example apply; pipeline stages compute the loss on the
    last stage, tensor-parallel heads redistribute their output in hooks."""
    fuses_lora: bool = False
    """Each LoRA layer's forward and backward may run as one autograd function reading its weights at call time
    (``training.kernels.lora_fused``): not where each module's weights are gathered as it is called (ZeRO-3), nor
    on stages that have not been checked with it."""
    plain_head: bool = False
    """The head stays a plain ``nn.Linear`` (Liger's fused loss takes its weight; FSDP2's units change its class)."""
    autocast: bool = False
    """It runs under accelerate's autocast with float32 adapters (the others compute in the run's dtype already:
    FSDP2's param_dtype, DeepSpeed's 16-bit module)."""
    loads_lazily: bool = True
    """The worker builds an empty model (``empty_context``) and ``wrap`` fills in only what this rank holds
    (``ladle.train.loading``). False: ``from_pretrained`` with ``load_kwargs`` loads it."""

    # -- planner side: options ---------------------------------------------------------------------

    def compile_asked(self, options: Section | None) -> str | None:
        """The strategy option that asks for compiled blocks whatever ``training.kernels.compile`` says, named
        as the config writes it (``parallelism.fsdp2.compile = true``), or None."""
        return None

    def options(self, cfg: LadleConfig) -> Section | None:
        """This strategy's option section of ``cfg`` (None when it has none). Under online RL a strategy that
        shards every weight keeps the embedding and head whole (``shard_head`` off): its engine samples on whole
        weights, gathered for the rollouts, so nothing may be held vocabulary-parallel."""
        section = getattr(cfg.parallelism, self.options_section) if self.options_section else None
        if self.shards_tensors and cfg.training.objective == "grpo" and getattr(section, "shard_head", False):
            section = section.model_copy(update={"shard_head": False})
        return section

    def with_options(self, cfg: LadleConfig, updates: dict[str, Any]) -> LadleConfig:
        """A copy of ``cfg`` whose option section carries ``updates`` (validated); ``cfg`` is unchanged."""
        if not updates:
            return cfg
        section = self.options(cfg).model_validate({**self.options(cfg).model_dump(), **updates})
        parallelism = cfg.parallelism.model_copy(update={self.options_section: section})
        return cfg.model_copy(update={"parallelism": parallelism})

    def offload(self, options: Section | None) -> tuple[bool, bool]:
        """Whether ``options`` move (optimizer state, parameters) to host memory."""
        return False, False

    def label(self, options: Section | None) -> str:
        """The candidate's name in the plan: the strategy plus the variant its options select."""
        return self.name + ("+offload" if any(self.offload(options)) else "")

    # -- planner side: layout ----------------------------------------------------------------------

    def processes(self, cfg: LadleConfig, device: str, per_machine: int) -> tuple[int, str | None]:
        """Processes per machine this strategy runs (``per_machine`` unless it adapts it), and why it changed."""
        return per_machine, None

    def dims(self, options: Section | None, world_size: int, nodes: int) -> Dims:
        """The parallelism degrees this strategy runs as (the plan's ``mesh``): data-parallel replicas by
        default. Named strategies are presets of degrees; ``nd`` composes them."""
        return Dims(dp_replicate=world_size)

    def data_parallel_degree(self, world_size: int, options: Section | None) -> int:
        """Replicas reading different rows; the rest of the ranks share a replica's batch."""
        return world_size

    def default_accumulation(self, options: Section | None) -> int:
        """Gradient accumulation (microbatches per step) when no global batch is asked for."""
        return 1

    def asked_for(self, cfg: LadleConfig) -> bool:
        """True when the config's own options of this strategy select it while ``parallelism.strategy`` is
        ``auto`` (``nd``: degrees set in ``parallelism.dims``)."""
        return False

    def settle_options(
        self, job: sizing.Job | None, options: Section | None, capacity: int | None, lora: bool, per_rank: int
    ) -> tuple[dict[str, Any], tuple[str, ...]]:
        """Options left ``auto`` that only the batch layout decides, made explicit (updates, and the plan's
        reasons for them): ``per_rank`` micro-batches a rank each step, ``job`` None where the model's size is
        unknown, ``capacity`` a rank's memory (None: unknown). Nothing by default."""
        return {}, ()

    # -- planner side: checks ----------------------------------------------------------------------

    @abstractmethod
    def validate(self, cfg: LadleConfig, topo: Topology, target: Target) -> list[str]:
        """Problems that stop this strategy on this machine (field = value: why. fix.)."""

    def validate_model(self, cfg: LadleConfig, model: dict, world_size: int) -> list[str]:
        """Problems with this model's shape for this strategy (the planner has the config.json)."""
        return []

    def validate_batch(self, options: Section | None, micro: int, accumulation: int, global_batch: int) -> list[str]:
        """Problems with the batch layout the planner settled on."""
        return []

    def validate_unused(self, cfg: LadleConfig, chosen: Strategy) -> list[str]:
        """Problems with this strategy's options when ``chosen`` runs instead (an option that would be ignored)."""
        return []

    # -- planner side: sizing ----------------------------------------------------------------------

    def candidates(self, job: sizing.Job, interconnect: str, cfg: LadleConfig) -> list[Candidate]:
        """The variants of this strategy worth sizing for ``job`` on ``interconnect``, with their rank.

        Communication per step, in units of one all-reduce of the trained weights, sets the rank:
        DDP, ZeRO-1 and ZeRO-2 move 1 (reduce-scatter + all-gather); ZeRO-3 and FSDP2 1.5 (weights
        gathered again for backward); offload adds a host round trip over PCIe every step. LoRA
        trains few weights, so its communication is small whatever the strategy and only the frozen
        base's memory matters. A strategy with no candidates is used only when named explicitly.
        """
        return []

    def model_states(self, job: sizing.Job, options: Section | None) -> memory.ModelStates:
        """Per-rank weights, gradients and optimizer state of a full fine-tune (default: a full replica)."""
        return memory.ddp(job.shape.params)

    def lora_base_ranks(self, job: sizing.Job, options: Section | None) -> int:
        """Ranks the frozen base of a LoRA run is divided over (1: each rank holds all of it)."""
        return 1

    def runs_whole_forward(self, options: Section | None) -> bool:
        """Whether each rank runs the model's whole forward, embedding to head, as one call (``whole_forward``
        for the strategy's options): the fused loss, padding-free micro-batches and packed attention need it."""
        return self.whole_forward

    def pairs_refusal(self, options: Section | None) -> str | None:
        """Why preference pairs (``training.objective: dpo``) cannot train with this strategy and ``options``
        (None: they can). A side's log-probability is a sum over its whole row's labelled tokens, each over the
        whole vocabulary: the pair loss runs where the model's own forward runs on whole rows, head included."""
        if self.runs_whole_forward(options):
            return None
        return (
            f"{self.name} does not run the model's whole forward on whole rows on each rank, where a side's "
            "log-probability is summed"
        )

    def rollouts_refusal(self, options: Section | None) -> str | None:
        """Why online RL (``training.objective: grpo``) cannot sample its rollouts under this strategy (None: it
        can). ladle's engine samples inside each rank with a KV cache, on the rank's own copy of every weight:
        the strategy must run the whole forward and keep whole parameters on each rank."""
        if not self.runs_whole_forward(options):
            return f"{self.name} does not run the model's whole forward on each rank, where the engine samples"
        if self.shards_tensors:
            return (
                f"{self.name} keeps a shard of every weight on each rank; the engine samples with whole weights, "
                "and gathering them for the rollouts is built for ZeRO-3 and FSDP2, not yet for this strategy"
            )
        return None

    def logits_bytes(self, job: sizing.Job, options: Section | None) -> int:
        """The logits of one micro-batch and their float32 softmax (tokens x vocabulary); with the ends kept
        sharded, the vocabulary-parallel loss's chunks over this rank's rows."""
        tokens = job.logit_tokens()
        if self.ends_gathered(job, options):
            fused = self.runs_whole_forward(options)
            return sizing.logits_bytes(
                job.shape,
                tokens,
                job.dtype_bytes,
                job.loss_chunk_bytes if fused else 0,
                liger=self.plain_head and job.liger_loss and job.loss_chunk_bytes > 0,
            )
        return sizing.vocab_parallel_logits_bytes(job.shape, tokens, job.dtype_bytes, job.world)

    def eval_micro_batch(self, job: sizing.Job, options: Section | None) -> tuple[int, str]:
        """Rows per eval forward, and why: the largest multiple of the training micro-batch, up to
        ``EVAL_MICRO_MAX`` times it, whose no-grad forward (one layer's activations alive at a time, and the
        logits) needs no more than a training micro-batch's activations and logits. Fewer eval forwards: a
        sharded forward gathers every layer once per micro-batch."""
        budget = self.activations(job, options)[0] + self.logits_bytes(job, options)
        rows = job.micro_batch
        for times in range(2, EVAL_MICRO_MAX + 1):
            wider = replace(job, micro_batch=job.micro_batch * times)
            one_layer = sizing.activation_bytes(
                wider.shape, wider.micro_batch * wider.seq_len, 1, wider.dtype_bytes, False
            )
            if one_layer + self.logits_bytes(wider, options) > budget:
                break
            rows = wider.micro_batch
        return rows, (
            f"{rows // job.micro_batch}x the training micro-batch: a no-grad forward holds one layer's activations "
            f"and the logits, within the {sizing.gib(budget)} a training micro-batch's activations and logits take"
        )

    def ends_gathered(self, job: sizing.Job, options: Section | None) -> bool:
        """Whether a sharded model's input embedding and output head are gathered whole for their forward and
        backward (false where they stay sharded: FSDP2's vocabulary-parallel ends)."""
        return True

    def activations(self, job: sizing.Job, options: Section | None) -> tuple[int, str]:
        """Activation bytes alive on a rank at the end of one micro-batch's forward, and how they were counted."""
        acts = sizing.activation_bytes(
            job.shape, job.forward_tokens(), job.shape.layers, job.dtype_bytes, job.checkpointing
        )
        if not job.shared_prompts:
            return acts, ""
        # grpo's shared prompts: each row's copy of its prompt's keys and values, which its attention saves
        prompt = job.seq_len - job.completion_tokens
        copies = job.micro_batch * prompt * 2 * job.shape.kv_dim * job.dtype_bytes * job.shape.layers
        return acts + copies, (
            f"{job.shared_prompts} shared prompt(s) of up to {prompt} tokens and {job.micro_batch} completions of up to "
            f"{job.completion_tokens}, with each row's copy of its prompt's keys and values"
        )

    def mask_bytes(self, job: sizing.Job, options: Section | None) -> int:
        """The block-diagonal masks of packed rows that attention saves on CUDA when it does not run example by
        example (``sizing.attention_mask_bytes``); strategies with stages of their own count their masks in
        their ``activations``."""
        if not (job.cuda and job.masked and self.runs_whole_forward(options)):
            return 0
        layers = 1 if job.checkpointing else job.shape.layers
        return sizing.attention_mask_bytes(layers, job.micro_batch, job.seq_len, job.dtype_bytes)

    def estimate(self, job: sizing.Job, options: Section | None) -> sizing.Estimate:
        """Per-rank memory of one training step of ``job`` with ``options``."""
        if job.lora:
            ranks, offload = self.lora_base_ranks(job, options), self.offload(options)[1]
            states = sizing.lora_states(job, ranks, offload, self.ends_gathered(job, options))
        else:
            states = self.model_states(job, options)
        acts, note = self.activations(job, options)
        if not job.cuda:
            acts = int(acts * sizing.CPU_RESIDENT_ACTIVATIONS["lora" if job.lora else "full"])
        elif job.compiled and self.compiles_blocks:
            acts = int(acts * sizing.COMPILED_ACTIVATIONS)
        acts += self.mask_bytes(job, options)
        logits = self.logits_bytes(job, options)
        load = self.load_bytes(job, options, states)
        step = self.step_bytes(job, options, states)
        save = 0 if job.cuda else self.save_bytes(job, options, states)
        estimate = sizing.Estimate.of(self.label(options), states, acts, logits, job, note, load, step, save)
        if job.rollout_bytes:
            gathered = job.shape.params * job.dtype_bytes if self.shards_tensors else 0
            # On a CPU the update runs beside what the host heap kept of the rollouts' freed memory: their KV
            # cache, logits and buffers, and under sharding part of the weights gathered for them (``heap_kept``).
            # Not the merged copy: its matrices go back to the system when freed (measured: the same peak with and
            # without it, bench/RESULTS.md).
            transient = job.rollout_bytes - job.rollout_merged
            kept = 0 if job.cuda else transient + (self.heap_kept(job, states, gathered) if gathered else 0)
            estimate = replace(estimate, rollout=job.rollout_bytes + gathered, kept=kept)
        if job.frozen_reference:  # in the run's dtype; divided over the ranks where the weights are sharded
            ranks = job.world if self.shards_tensors else 1
            estimate = replace(estimate, reference=job.shape.params * job.dtype_bytes // max(ranks, 1))
        return estimate

    def heap_kept(self, job: sizing.Job, states: memory.ModelStates, gathered: int) -> int:
        """grpo on a CPU: what the host heap keeps through the update of the ``gathered`` weights the rollouts
        freed. glibc raises its mmap threshold to a freed block's size, so later blocks of that size come from the
        heap, whose freed pages stay resident (with the threshold pinned, ``MALLOC_MMAP_THRESHOLD_``, the part
        vanishes: bench/RESULTS.md). Measured on SmolLM2 under FSDP2 at about the part of the weights the rank
        does not hold (bench/grpo_memory.py)."""
        return max(0, gathered - weights_held(job, states))

    def step_bytes(self, job: sizing.Job, options: Section | None, states: memory.ModelStates) -> int:
        """Temporaries of torch AdamW's step beyond its states, for the parameters this rank steps. On CUDA the
        foreach kernels take sqrt(v) of every element at once: one float32 temporary per element. On CPU the
        step goes tensor by tensor: two float32 temporaries of the largest local tensor (sqrt(v), then its
        division)."""
        local = stepped_elements(job, states)
        if job.cuda:
            return 4 * local
        largest = job.shape.largest_tensor * local // max(job.shape.params, 1)
        return 8 * min(largest, local)

    def save_bytes(self, job: sizing.Job, options: Section | None, states: memory.ModelStates) -> int:
        """What saving adds to the states on rank 0: what it gathers at once (``gathered_for_save``), less the
        gradients the last step freed (torch's zero_grad sets them to None)."""
        freed = stepped_elements(job, states) * (4 if job.dtype_bytes == 4 else memory.GRAD_16)
        return max(0, gathered_for_save(job) - freed)

    def load_bytes(self, job: sizing.Job, options: Section | None, states: memory.ModelStates) -> int:
        """Memory at the end of loading: the weights this rank holds, plus the tensor being read (lazy loading
        reads one at a time, so a rank never holds more than its share and one tensor)."""
        return weights_held(job, states) + job.shape.largest_tensor * job.dtype_bytes

    # -- planner side: rendering -------------------------------------------------------------------

    def configure(self, cfg: LadleConfig, plan: Plan) -> tuple[dict, list[str]]:
        """The strategy's launcher config (e.g. the DeepSpeed JSON), rendered from the plan, and the reasons
        for any value it resolved itself. Runs in the planner: no heavy imports."""
        return {}, []

    def before_launch(self, plan: Plan) -> None:
        """Last check in the launching process, where heavy imports are fine (e.g. DeepSpeed's config model).

        Raises:
            ValueError: the rendered launcher config is rejected.
        """
        return None  # most strategies render nothing that needs a second check

    def launcher_args(self, plan: Plan) -> list[str]:
        """Arguments for ``accelerate launch`` that select this strategy."""
        if plan.world_size == 1:
            return ["--cpu"] if plan.device == "cpu" else []
        # `--cpu --num_processes N` starts ONE process; --multi_gpu (torchrun underneath) starts N, and
        # the worker selects gloo with cpu=True. Every strategy is applied by ladle in the worker.
        return ["--multi_gpu"]

    native_checkpoint = False
    """True: checkpoints are the engine's own per-rank files, resumable only by the same strategy and world
    size. False: a torch distributed checkpoint (DCP) of the trainable state: each rank writes the shards it
    holds, nothing is gathered on one rank, and any strategy of this kind resumes from it at any world size
    (DCP reads whatever region each rank now holds)."""


def output_bytes(job: sizing.Job) -> int:
    """The run's outputs in its dtype: the full weights of a full fine-tune, the adapters of a LoRA run."""
    return (job.shape.trainable if job.lora else job.shape.params) * job.dtype_bytes


def gathered_for_save(job: sizing.Job) -> int:
    """What rank 0 holds gathered at once while saving, in the run's dtype: a LoRA run's adapters; a full
    fine-tune's current part (``training.save_shard_mib``, or one larger tensor: ``full_model_parts``) plus
    the tensor being gathered into it."""
    if job.lora:
        return output_bytes(job)
    largest = job.shape.largest_tensor * job.dtype_bytes
    return min(output_bytes(job), max(job.save_shard_bytes, largest)) + largest


def weights_held(job: sizing.Job, states: memory.ModelStates) -> int:
    """The weights a rank holds once loaded. ZeRO-3's mixed-precision layout counts a full fine-tune's 16-bit
    weights inside its optimizer term: then the rank's share."""
    return states.weights or job.dtype_bytes * job.shape.params // max(1, job.world)


def stepped_elements(job: sizing.Job, states: memory.ModelStates) -> int:
    """The parameters this rank's torch optimizer steps, read off its optimizer state (AdamW's two float32
    moments in a float32 run; the mixed-precision layout's 16 bytes otherwise)."""
    return states.optimizer // (8 if job.dtype_bytes == 4 else memory.FP32_STATES)
