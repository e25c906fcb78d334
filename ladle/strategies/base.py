"""The strategy interface: everything one strategy knows, from sizing to saving its state.

A strategy is one small class. Its planner side (no torch import, no process
or GPU touched) names it, validates it against the machine, sizes its per-rank
memory, ranks it for an interconnect and node count, and renders its launcher
config; its worker side wraps the model inside each training process, checks
that what runs is what was planned, and saves and loads its state. Adding a
strategy is adding a class and registering it in ``ladle.strategies``: the
config's strategy type, the CLI's choices and the docs come from the registry.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ladle import sizing
from ladle.platform import storage
from ladle.sizing import memory
from ladle.strategies.mesh import Dims
from ladle.train.kernels import COMPILE_STRATEGIES, FUSED_LOSS_STRATEGIES, LIGER_LOSS_STRATEGIES

if TYPE_CHECKING:
    from ladle.machine.topology import Topology
    from ladle.section import Section
    from ladle.train.loading import Pending

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


class Strategy(ABC):
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
    loads_lazily: bool = True
    """The worker builds an empty model (``empty_context``) and ``wrap`` fills in only what this rank holds
    (``ladle.train.loading``). False: ``from_pretrained`` with ``load_kwargs`` loads it."""

    # -- planner side: options ---------------------------------------------------------------------

    def options(self, cfg: LadleConfig) -> Section | None:
        """This strategy's option section of ``cfg`` (None when it has none)."""
        return getattr(cfg.parallelism, self.options_section) if self.options_section else None

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

    def logits_bytes(self, job: sizing.Job, options: Section | None) -> int:
        """The logits of one micro-batch and their float32 softmax (tokens x vocabulary); with the ends kept
        sharded, the vocabulary-parallel loss's chunks over this rank's rows."""
        tokens = job.micro_batch * job.seq_len
        if self.ends_gathered(job, options):
            fused = self.name in FUSED_LOSS_STRATEGIES
            return sizing.logits_bytes(
                job.shape,
                tokens,
                job.dtype_bytes,
                job.loss_chunk_bytes if fused else 0,
                liger=self.name in LIGER_LOSS_STRATEGIES and job.liger_loss and job.loss_chunk_bytes > 0,
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
        tokens = job.micro_batch * job.seq_len
        return sizing.activation_bytes(job.shape, tokens, job.shape.layers, job.dtype_bytes, job.checkpointing), ""

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
        elif job.compiled and self.name in COMPILE_STRATEGIES:
            acts = int(acts * sizing.COMPILED_ACTIVATIONS)
        logits = self.logits_bytes(job, options)
        load = self.load_bytes(job, options, states)
        step = self.step_bytes(job, options, states)
        save = 0 if job.cuda else self.save_bytes(job, options, states)
        return sizing.Estimate.of(self.label(options), states, acts, logits, job, note, load, step, save)

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

    def accelerator_kwargs(self, plan: Plan) -> dict[str, Any]:
        """Keyword arguments for ``accelerate.Accelerator`` in the worker."""
        return {}

    def empty_context(self, plan: Plan, dtype):
        """The context the worker builds the empty model in: parameters on the meta device by default."""
        from ladle.train.loading import meta_context

        return meta_context()

    @abstractmethod
    def wrap(self, accelerator, model, make_optimizer: Callable, plan: Plan, pending: Pending | None = None):
        """Distribute ``model``, load what ``pending`` says it still lacks (only this rank's part), then build
        its optimizer with ``make_optimizer(model)`` (after sharding, so the optimizer holds shards); returns
        the model and the optimizer."""

    @abstractmethod
    def check_applied(self, accelerator, model, plan: Plan) -> dict:
        """Raise if what runs is not what was planned (no silent fallback); return what was verified."""

    def no_sync(self, accelerator, model):
        """Context that skips gradient synchronisation on accumulation micro-steps."""
        return accelerator.no_sync(model)

    def backward(self, accelerator, model, loss, boundary: bool) -> None:
        """Backward of one micro-batch; ``boundary`` marks the last one before the optimizer step."""
        accelerator.backward(loss)

    def optimizer_step(self, accelerator, model, optimizer, max_grad_norm: float) -> None:
        """Clip (when ``max_grad_norm`` > 0), step and zero the gradients."""
        if max_grad_norm > 0:
            # The optimizer's parameters are the trained ones: listing them skips a walk over every module
            # (3 ms of a 120 ms step on the tiny model).
            accelerator.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]], max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def full_state_dict(self, accelerator, model, trainable_only: bool) -> dict | None:
        """The unsharded state dict, gathered collectively (every rank calls this); complete on rank 0."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(model, options=state_options(trainable_only=trainable_only))

    def full_model_parts(self, accelerator, model, max_bytes: int) -> Iterator[dict | None]:
        """The full model's weights in parts of at most ``max_bytes`` (a larger tensor alone), gathered one part
        at a time, one tensor after another (collective: every rank iterates): whole CPU tensors on rank 0, None
        elsewhere. Rank 0 never holds more than the part and the tensor being gathered (``ladle.train.saving``)."""
        from ladle.train import saving

        yield from saving.gather_parts(
            self.unwrap(accelerator, model), self.whole, accelerator.is_main_process, max_bytes
        )

    @contextmanager
    def whole(self, tensor):
        """``tensor`` whole while the context lasts (a DTensor's ``full_tensor``, a collective over its mesh)."""
        from torch.distributed.tensor import DTensor

        yield tensor.full_tensor() if isinstance(tensor, DTensor) else tensor

    native_checkpoint = False
    """True: checkpoints are the engine's own per-rank files, resumable only by the same strategy and world
    size. False: a torch distributed checkpoint (DCP) of the trainable state: each rank writes the shards it
    holds, nothing is gathered on one rank, and any strategy of this kind resumes from it at any world size
    (DCP reads whatever region each rank now holds)."""

    def save_state(self, model, optimizer, folder: str, tag: str) -> dict:
        """Checkpoint the model and optimizer (collective): every rank writes its files under ``folder/tag``;
        returns what ``state.pt`` should carry besides (nothing here)."""
        dcp_save(model, optimizer, folder, tag)
        return {}

    def load_state(self, model, optimizer, payload: dict, url: str, tag: str) -> None:
        """Restore what ``save_state`` wrote: ``payload`` is ``state.pt``; ``url`` is the checkpoint's folder
        in the artifact store (local or remote), read in place: each rank reads only what it needs."""
        dcp_load(model, optimizer, url, tag)

    def forward_backward(
        self, accelerator, model, data, batch: list[int], plan: Plan, denominator: int, loss_fn
    ) -> float:
        """Forward and backward of this rank's share of the global ``batch`` (row indices).

        ``loss_fn(model, data, rows, device)`` returns the summed token loss of ``rows`` and their
        token count. Returns this rank's summed (unscaled) loss, for logging.
        """
        from contextlib import nullcontext

        from ladle.train import schedule

        loss_fn = vocab_parallel_loss(model, loss_fn)
        rank, replicas = self.data_parallel(accelerator)
        micros = schedule.micro_batches(batch, rank, replicas, plan.micro_batch_size)
        local_sum = 0.0
        for m, rows in enumerate(micros):
            sync = m == len(micros) - 1
            with self.no_sync(accelerator, model) if not sync else nullcontext():
                loss, _ = loss_fn(model, data, rows, accelerator.device)
                # Data-parallel reductions average gradients over replicas; scale so the result is the global token mean.
                self.backward(accelerator, model, loss * replicas / denominator, boundary=sync)
            local_sum += loss.item()
        # Ranks of one replica computed the same loss: count it once in the all-rank sum.
        return local_sum * replicas / accelerator.num_processes

    def evaluate(self, accelerator, model, data, micro: int, loss_fn) -> float:
        """Token-weighted loss over all rows of ``data``, the same on every rank.

        Every rank runs the same number of forward passes: a sharded model's
        forward is a collective (FSDP2 and ZeRO-3 gather each layer), so a rank
        with one row fewer would leave the others waiting forever. A rank out of
        rows runs its last batch again and does not count it.
        """
        import torch

        loss_fn = vocab_parallel_loss(model, loss_fn)
        rank, replicas = self.data_parallel(accelerator)
        rows = len(data["input_ids"])
        mine = list(range(rank, rows, replicas))
        most = -(-rows // replicas)  # rows of the fullest rank
        total = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
        with torch.no_grad():
            for start in range(0, most, micro):
                chunk = mine[start : start + micro]
                loss, count = loss_fn(model, data, chunk or mine[-micro:] or [0], accelerator.device)
                if chunk:
                    total += torch.tensor([loss.item(), count], dtype=torch.float64, device=accelerator.device)
        total = accelerator.reduce(total, reduction="sum")  # every rank of a replica adds the same totals
        return float(total[0] / max(total[1], 1))

    def data_parallel(self, accelerator) -> tuple[int, int]:
        """This rank's data-parallel index and the number of replicas (ranks reading different rows)."""
        return accelerator.process_index, accelerator.num_processes

    def load_kwargs(self, accelerator, plan: Plan) -> dict[str, Any]:
        """Extra ``from_pretrained`` arguments (e.g. a tensor-parallel plan and mesh)."""
        return {}

    def hf_model(self, accelerator, model):
        """The Hugging Face (or peft) model object whose ``save_pretrained`` writes the output."""
        return self.unwrap(accelerator, model)

    def unwrap(self, accelerator, model):
        """The module under the data-parallel wrapper ``accelerator.prepare`` put around it (DDP's, if any).

        Not ``accelerator.unwrap_model``: to test for DeepSpeed's engine it imports DeepSpeed whenever DeepSpeed
        is installed, 0.9 s of CPU in each process of a DDP or FSDP2 run (measured on the tiny model's save).
        The strategies that wrap in DeepSpeed's engine use it (``ZeRO.unwrap``).
        """
        from torch.nn import DataParallel
        from torch.nn.parallel import DistributedDataParallel

        while isinstance(model, DistributedDataParallel | DataParallel):
            model = model.module
        return model


def vocab_parallel_loss(model, loss_fn):
    """The loss to run: the vocabulary-parallel one (``runtime.vocab_parallel.ShardedVocab``) where the wrapped
    model keeps an end sharded (FSDP2, ZeRO-3's frozen ends), else ``loss_fn``."""
    vocab = getattr(model, "ladle_vocab", None)
    return vocab.token_loss if vocab is not None else loss_fn


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


def state_options(trainable_only: bool = True, **extra):
    """Full (unsharded) state, gathered to CPU on rank 0: the same checkpoint layout
    whatever the strategy (DDP replica or FSDP2 shards)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only, **extra)


def dcp_save(module, optimizer, folder: str, tag: str) -> None:
    """The trainable state of ``module`` and its optimizer as a torch distributed checkpoint under
    ``folder/tag``: each rank writes the shards it holds (a replicated tensor is written by one rank)."""
    from pathlib import Path

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(ignore_frozen_params=True)
    model_state, optim_state = get_state_dict(module, inner(optimizer), options=options)
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=Path(folder) / tag)


def dcp_load(module, optimizer, url: str, tag: str) -> None:
    """Load ``dcp_save``'s checkpoint at ``url/tag`` into ``module`` and its optimizer, whatever the sharding
    it was written with: each rank reads the regions it now holds (``dcp_reader``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    options = StateDictOptions(ignore_frozen_params=True)
    model_state, optim_state = get_state_dict(module, inner(optimizer), options=options)
    state = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, storage_reader=dcp_reader(storage.join(url, tag)))
    set_state_dict(
        module,
        inner(optimizer),
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
        options=StateDictOptions(ignore_frozen_params=True, strict=False),
    )


def dcp_reader(url: str):
    """A DCP reader of the checkpoint at ``url``, read in place: a rank opens only the files that hold the
    regions it loads and reads only those regions (byte ranges, on an object store). Never a download of the
    whole checkpoint to every rank: at 70B with optimizer states that is ~1 TB per rank."""
    from torch.distributed.checkpoint import FileSystemReader

    if storage.is_local(url):
        return FileSystemReader(storage.local_path(url))
    # fsspec's reader (torch ships it, not exported from torch.distributed.checkpoint): the same URL and the
    # same credentials (the environment's) as the rest of the artifact store.
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return FsspecReader(url)


def inner(optimizer):
    """The torch optimizer under accelerate's wrapper."""
    return getattr(optimizer, "optimizer", optimizer)
