"""A strategy's worker side (``Runtime``): how a rank wraps the model, steps, gathers and saves it, and the
distributed-checkpoint helpers the runtimes share. The strategies in ``ladle.strategies`` decide (options,
checks, candidates, memory, launch); the runtimes here apply the decision inside the training processes. Each
strategy names its runtime (``Strategy.runtime``, a ``module:Class`` path) and ``runtime_for`` makes it, so the
planner never imports this side and this side never reaches back into the planner's decisions."""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from ladle.platform import storage

if TYPE_CHECKING:
    from ladle.plan.model import Plan
    from ladle.train.loading import Pending


def runtime_for(strategy) -> Runtime:
    """The runtime ``strategy`` (a registered strategy or its name) names: one per strategy in a process (a
    training process runs one plan; the runtime keeps what wrapping made, e.g. the N-D device mesh)."""
    if isinstance(strategy, str):
        from ladle import strategies

        strategy = strategies.get(strategy)
    if not strategy.runtime:
        raise RuntimeError(f"strategy {strategy.name!r} names no runtime (Strategy.runtime): it cannot run")
    if strategy.name not in MADE or MADE[strategy.name].strategy is not strategy:
        module, _, name = strategy.runtime.partition(":")
        MADE[strategy.name] = getattr(importlib.import_module(module), name)(strategy)
    return MADE[strategy.name]


MADE: dict[str, Runtime] = {}


class Runtime(ABC):
    """A strategy's worker side: how a rank wraps the model, steps, gathers and saves it. The planning side (the
    strategy in ``ladle.strategies``) names its runtime (``Strategy.runtime``); the worker makes one per run
    (``runtime_for``). The defaults here are plain data parallel under accelerate; ``wrap`` and
    ``check_applied`` have none."""

    def __init__(self, strategy) -> None:
        self.strategy = strategy

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
        # Gradients are averaged over the replicas and the ranks that split their sequences (each computes the
        # gradient of its slice's summed loss): scale so their mean is the global token mean.
        averaged = replicas * self.sequence_split()
        micros = schedule.micro_batches(batch, rank, replicas, plan.micro_batch_size)
        local_sum = 0.0
        for m, rows in enumerate(micros):
            sync = m == len(micros) - 1
            with self.no_sync(accelerator, model) if not sync else nullcontext():
                loss, _ = loss_fn(model, data, rows, accelerator.device)
                self.backward(accelerator, model, loss * averaged / denominator, boundary=sync)
            local_sum += loss.item()
        # Ranks of one replica computed the same loss (a slice each with sequence parallelism): count it once in
        # the all-rank sum.
        return local_sum * averaged / accelerator.num_processes

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
        total = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
        with torch.no_grad():
            for batch, counted in even_batches(list(range(rows)), rank, replicas, micro):
                if counted:
                    loss, count = loss_fn(model, data, batch, accelerator.device)
                    total += torch.tensor([loss.item(), count], dtype=torch.float64, device=accelerator.device)
                elif getattr(loss_fn, "records_rows", False):  # a pair loss keeps each row's rewards: not these
                    loss_fn(model, data, batch, accelerator.device, record=False)
                else:
                    loss_fn(model, data, batch, accelerator.device)
        total = accelerator.reduce(total, reduction="sum")  # every rank of a replica adds the same totals
        return float(total[0] / max(total[1], 1))

    def data_parallel(self, accelerator) -> tuple[int, int]:
        """This rank's data-parallel index and the number of replicas (ranks reading different rows)."""
        return accelerator.process_index, accelerator.num_processes

    def sequence_split(self) -> int:
        """Ranks each row is split across (sequence parallelism's degree; 1: every rank holds whole rows)."""
        return 1

    def load_kwargs(self, accelerator, plan: Plan) -> dict[str, Any]:
        """Extra ``from_pretrained`` arguments (e.g. a tensor-parallel plan and mesh)."""
        return {}

    def whole_weights(self, accelerator, model):
        """A context in which the Hugging Face model's forward runs on this rank alone, on whole weights: where
        online RL's engine samples (``ladle.train.grpo_run``). Every rank enters it at the same point. Nothing to
        do where each rank holds every weight."""
        from contextlib import nullcontext

        return nullcontext()

    def frozen_copy(self, accelerator, policy, base_dir, plan: Plan):
        """A frozen copy of the starting weights beside the trained model, for no-grad forwards (online RL's KL
        reference of a full fine-tune); made before any checkpoint is resumed into ``policy``. Where each rank
        holds every weight it is a copy of the rank's replica. A strategy that shards the weights builds its own
        copy from ``base_dir`` sharded as the trained model is (``wrap_frozen``): a rank then holds its share of
        the reference, not a whole one. Returns the module whose forward scores (the Hugging Face model)."""
        import copy

        if not self.strategy.shards_tensors:
            return copy.deepcopy(policy).eval().requires_grad_(False)
        from ladle.train import loading

        model, pending = loading.skeleton(base_dir, plan, self)
        model.config.use_cache = False
        model.requires_grad_(False)
        pending.values = loading.kept_values(model)  # its buffers, which filling the skeleton would wipe
        wrapped = self.wrap_frozen(accelerator, model, plan, pending)
        hf = self.hf_model(accelerator, wrapped).eval()
        hf.ladle_wrapper = wrapped  # what holds the sharding's hooks stays alive as long as the model
        return hf

    def wrap_frozen(self, accelerator, model, plan: Plan, pending: Pending):
        """Shard a frozen ``model`` as ``wrap`` shards the trained one, with no optimizer, filling ``pending``
        (each rank reads only its part)."""
        raise RuntimeError(
            f"{self.strategy.name} shards the weights but builds no frozen copy of them (Runtime.wrap_frozen)"
        )

    def hf_model(self, accelerator, model):
        """The Hugging Face (or peft) model object whose ``save_pretrained`` writes the output."""
        return self.unwrap(accelerator, model)

    def forward_model(self, accelerator, model):
        """The model whose forward the loss calls, where the per-forward kernels install (the fused loss's head,
        attention example by example): the Hugging Face model unless the runtime keeps a stand-in for saving."""
        return self.hf_model(accelerator, model)

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


def even_batches(rows: list[int], rank: int, replicas: int, micro: int):
    """This rank's share of ``rows`` (every ``replicas``-th from ``rank``) in micro-batches, as ``(batch,
    counted)``, with as many batches on every rank: a sharded model's forward is a collective (FSDP2 and ZeRO-3
    gather each layer), so a rank with one batch fewer would leave the others waiting forever. A rank out of rows
    runs its last batch again (or, with none, the first row) and must not count it."""
    mine = rows[rank::replicas]
    most = -(-len(rows) // replicas)  # rows of the fullest rank
    for start in range(0, most, micro):
        chunk = mine[start : start + micro]
        yield (chunk, True) if chunk else (mine[-micro:] or rows[:1] or [0], False)


def vocab_parallel_loss(model, loss_fn):
    """The loss to run: the vocabulary-parallel one (``runtime.vocab_parallel.ShardedVocab``) where the wrapped
    model keeps an end sharded (FSDP2, ZeRO-3's frozen ends), else ``loss_fn``."""
    vocab = getattr(model, "ladle_vocab", None)
    if vocab is None or getattr(loss_fn, "handles_sharded_ends", False):  # a pair loss reads ``ladle_vocab`` itself
        return loss_fn
    return vocab.token_loss


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
