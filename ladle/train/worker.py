"""The per-rank training program the plan's launch starts (``accelerate launch`` on GPUs; on CPUs ladle's
launcher, which forks each rank and calls ``main``):

    accelerate launch ... -m ladle.train.worker SPEC.json

It reads the packed dataset from the artifact store, loads the base through
the ordinary Hugging Face path (with the strategy's loading arguments), applies
LoRA with peft, wraps the model with the planned strategy (which builds the
optimizer over its shards), checks that the wrapping really happened, resumes
from the newest complete checkpoint if there is one, and trains. Loss is the token-weighted mean over the whole
global batch, so it is the same whatever the world size or accumulation. Rank 0
alone writes progress lines, MLflow metrics, checkpoints and outputs.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import torch
from accelerate import Accelerator

from ladle.data.packing import IGNORE, read_rows
from ladle.platform import storage
from ladle.train import (
    checkpoint,
    kernels,
    loading,
    packed_attention,
    padding_free,
    preference,
    run_state,
    schedule,
    sequence_parallel,
)
from ladle.train.common import (
    KEPT,
    TRIM_EVERY_S,
    NonFiniteLoss,
    build_optimizer,
    build_scheduler,
    checkpoint_if_due,
    emit,
    emit_start,
    load_model,
    mlflow_logger,
    one_process_group,
    peak_memory_mib,
    release_freed_memory,
    report_done,
    save_outputs,
    training_parity,
    warm_imports,
    write_line,
)
from ladle.train.loss import token_loss
from ladle.train.preempt import PREEMPTED, PREEMPTION, Preempted, stopped_line
from ladle.train.runtime.base import runtime_for
from ladle.train.spec import PROGRESS_PREFIX, TrainResult, TrainSpec


def load_split(spec: TrainSpec, name: str) -> dict[str, torch.Tensor]:
    """A packed split (all its shards, in order) as tensors: input_ids, labels, position_ids, real_tokens."""
    parts = [
        read_rows(storage.read_bytes(storage.join(spec.dataset.url, shard))) for shard in spec.dataset.shards[name]
    ]
    return {key: torch.tensor([v for part in parts for v in part[key]], dtype=torch.long) for key in parts[0]}


def trained_tokens(data: dict[str, torch.Tensor], rows: list[int]) -> int:
    return int((data["labels"][torch.tensor(rows)][:, 1:] != IGNORE).sum())


def evaluate(accelerator: Accelerator, model, data: dict[str, torch.Tensor], spec: TrainSpec, loss_fn=token_loss):
    """Eval loss over all eval rows, the same on every rank: token-weighted, or the mean over pairs."""
    model.eval()
    micro = spec.plan.eval_micro_batch_size or spec.plan.micro_batch_size
    loss = runtime_for(spec.plan.strategy).evaluate(accelerator, model, data, micro, loss_fn)
    model.train()
    return loss


def eval_metrics(accelerator, model, data, spec: TrainSpec, loss_fn, known: float | None = None) -> dict[str, float]:
    """``eval_loss`` (``known``: already known exactly, no forward runs) and, for preference pairs, the held-out
    rewards and preference accuracy (collective)."""
    loss = evaluate(accelerator, model, data, spec, loss_fn) if known is None else known
    metrics = {"eval_loss": loss}
    if isinstance(loss_fn, preference.PairLoss):
        metrics.update({f"eval_{k}": v for k, v in loss_fn.take_stats(accelerator).items()})
    release_freed_memory(accelerator)
    return metrics


def with_reference(spec: TrainSpec, accelerator: Accelerator, model, loss_fn, splits: dict) -> tuple[str, bool]:
    """Put the reference log-probabilities beside each split's rows (``data["reference"]``) where the plan
    precomputes them: read from the run's artifacts when an earlier attempt of this run computed them for the same
    prepared data, else one no-grad pass now, by the model as loaded (the reference), written by rank 0.

    Returns:
        what ran, in words, and whether this model scored the pairs just now (it is then still the reference).
    """
    if not isinstance(loss_fn, preference.PairLoss) or loss_fn.reference != "precomputed":
        return (loss_fn.reference if isinstance(loss_fn, preference.PairLoss) else "off"), False
    url = storage.join(spec.run_url, preference.REFERENCE_FILE)
    stored = storage.read_json(url) if storage.exists(url) else None
    if stored is not None and stored.get("dataset") != spec.dataset.fingerprint:
        stored = None  # another prepared dataset: its rows are other pairs
    plan, cfg = spec.plan, spec.config
    micro = plan.eval_micro_batch_size or plan.micro_batch_size
    runtime = runtime_for(plan.strategy)
    train = splits["train"]
    rows = len(train["input_ids"])
    steps = schedule.total_steps(rows, plan.global_batch_size, cfg.training.max_steps, cfg.training.epochs)
    # A run that ends within its first epoch reads only some rows: only those are scored.
    needed = {"train": schedule.rows_visited(steps, rows, plan.global_batch_size, cfg.training.seed)}
    # An earlier attempt's table serves the rows it scored; the rows this attempt reads that it did not (more
    # steps, another global batch) are scored now, by the model as loaded, still the reference: the checkpoint
    # is loaded after this. Every rank reads the same file, so every rank decides the same.
    missing, reused = {}, 0
    for name, data in splits.items():
        count = len(data["input_ids"])
        table = torch.tensor(stored[name], dtype=torch.float64) if stored and name in stored else None
        if table is not None and tuple(table.shape) != (count, 2):
            table = None
        if table is None:
            table = torch.full((count, 2), float("nan"), dtype=torch.float64)
        wanted = needed.get(name, range(count))
        missing[name] = [r for r in wanted if torch.isnan(table[r]).any()]
        reused += len(wanted) - len(missing[name])
        data["reference"] = table
    if not any(missing.values()):
        return "precomputed: read from this run's earlier attempt", False
    began = time.perf_counter()
    for name, data in splits.items():
        if missing[name]:
            fresh = preference.reference_table(accelerator, model, data, micro, runtime, missing[name])
            data["reference"][missing[name]] = fresh[missing[name]]
    seconds = time.perf_counter() - began
    if accelerator.is_main_process:
        body = {name: data["reference"].tolist() for name, data in splits.items()}
        storage.write_json(url, {"dataset": spec.dataset.fingerprint, **body})
    scored = sum(len(m) for m in missing.values())
    said = f"precomputed: {scored} pair rows in {seconds:.1f} s before the first step"
    if reused:
        return f"{said}, {reused} read from this run's earlier attempt", False
    return said, True


def train_step(accelerator, model, optimizer, scheduler, data, step: int, spec: TrainSpec, loss_fn=token_loss) -> float:
    """One optimizer step over the global batch; returns its loss: token-weighted, or the mean over pairs."""
    plan, cfg = spec.plan, spec.config
    rows = len(data["input_ids"])
    batch = schedule.global_batch_rows(step, rows, plan.global_batch_size, cfg.training.seed)
    pairs = isinstance(loss_fn, preference.PairLoss)
    denominator = len(batch) if pairs else max(trained_tokens(data, batch), 1)
    runtime = runtime_for(plan.strategy)
    local_sum = runtime.forward_backward(accelerator, model, data, batch, plan, denominator, loss_fn)
    # The loss every rank agrees on, before the step: a non-finite one stops the run on every rank with its
    # weights as they were (its gradients would make every later step NaN too), the last checkpoint kept.
    total = accelerator.reduce(torch.tensor([local_sum], dtype=torch.float64, device=accelerator.device), "sum")
    loss = float(total[0]) / denominator
    if not math.isfinite(loss):
        raise NonFiniteLoss(
            f"the training loss of step {step + 1} is {loss}: its gradients were not applied and the run stops "
            "here (a retry resumes from its last complete checkpoint). Usual causes: training.lr too high for "
            "this model (lower it), float16 overflow (training.dtype: bfloat16), or rows without a trained "
            "token. Lower training.lr or set training.max_grad_norm, then run again."
        )
    runtime.optimizer_step(accelerator, model, optimizer, cfg.training.max_grad_norm)
    scheduler.step()
    return loss


@dataclass
class Session:
    """Everything one rank trains with, set up in order before the first step."""

    spec: TrainSpec
    accelerator: Accelerator
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    train: dict[str, torch.Tensor]
    evals: dict[str, torch.Tensor]
    steps: int
    start: int
    losses: list[float]
    eval_before: float
    log: object
    sharding: dict
    load_peak_mib: float
    baseline_mib: float
    kernels: dict
    loss_fn: object = token_loss
    eval_stats_before: dict | None = None


def setup(spec: TrainSpec) -> Session:
    """Accelerator -> data -> model (+LoRA) -> strategy wrap (+optimizer) -> check applied -> scheduler ->
    resume -> first eval (skipped on resume: the checkpoint carries it)."""
    plan, cfg = spec.plan, spec.config
    runtime = runtime_for(plan.strategy)
    one_process_group(plan)
    accelerator = Accelerator(cpu=plan.device == "cpu", **runtime.accelerator_kwargs(plan))
    if accelerator.num_processes != plan.world_size:
        raise RuntimeError(
            f"planned world size {plan.world_size} but the launcher started {accelerator.num_processes} process(es)"
        )
    warm_imports(runtime)
    torch.manual_seed(cfg.training.seed)
    train, evals = load_split(spec, "train"), load_split(spec, "eval")
    # The process before any weight: interpreter, libraries, the process group, the packed data (and the
    # memory pool pyarrow keeps after reading it).
    baseline = peak_memory_mib(accelerator)
    rows = len(train["input_ids"])
    if rows < plan.global_batch_size:
        raise RuntimeError(f"{rows} packed training rows cannot fill one global batch of {plan.global_batch_size}")
    steps = schedule.total_steps(rows, plan.global_batch_size, cfg.training.max_steps, cfg.training.epochs)
    model, pending, ran = load_model(spec, accelerator)
    model, optimizer = runtime.wrap(accelerator, model, lambda m: build_optimizer(m, cfg), plan, pending)
    live = runtime.forward_model(accelerator, model)
    if getattr(model, "ladle_vocab", None) is not None:
        ran["fused_loss"] = "vocabulary-parallel (the ends stay sharded)"
    else:
        ran["fused_loss"] = kernels.fused_head(live, plan.kernels, plan.device)
    if run_state.of(model).ulysses is not None:  # the runtime's wrap installs it where the plan splits sequences
        ran["sequence_parallel"] = "on"
        ran["packed_attention"] = "on: inside sequence-parallel attention, over the gathered sequence"
    else:
        ran["packed_attention"] = packed_attention.install(live, plan.kernels)
    ran["lora_fused"] = kernels.fuse_lora(live, plan.kernels)
    by_example = ran["packed_attention"].startswith("on")
    ran["padding_free"] = padding_free.install(live, plan.kernels, by_example)
    if leftover := loading.meta_parameters(model):
        raise RuntimeError(f"{plan.strategy}: {len(leftover)} parameter(s) were never loaded, e.g. {leftover[0]}")
    sharding = runtime.check_applied(accelerator, model, plan)
    loss_fn = token_loss
    if cfg.training.objective == "dpo":
        loss_fn = preference.PairLoss.from_config(cfg, plan.reference or "precomputed")
    elif cfg.training.objective == "kto":
        loss_fn = preference.KtoLoss.from_config(cfg, plan.reference or "precomputed")
    ran["reference"], scored_now = with_reference(spec, accelerator, model, loss_fn, {"train": train, "eval": evals})
    release_freed_memory(accelerator)
    load_peak = peak_memory_mib(accelerator)  # loading and wrapping done: the load's share of the peak
    scheduler = build_scheduler(optimizer, cfg, steps)
    state = checkpoint.load_latest(
        accelerator, storage.join(spec.run_url, "checkpoints"), model, optimizer, scheduler, plan, runtime
    )
    log = mlflow_logger(spec, accelerator)
    stats_before = None
    if state:
        eval_before = state.eval_before
    else:
        # The eval pairs just scored by this model as the reference: the eval before is known exactly.
        known = loss_fn.at_reference(evals) if scored_now else None
        before = eval_metrics(accelerator, model, evals, spec, loss_fn, known)
        eval_before = before.pop("eval_loss")
        stats_before = before or None
        log({"eval_loss": eval_before, **before}, 0)
    return Session(
        spec,
        accelerator,
        model,
        optimizer,
        scheduler,
        train,
        evals,
        steps,
        state.step if state else 0,
        list(state.losses) if state else [],
        eval_before,
        log,
        sharding,
        load_peak,
        baseline,
        ran,
        loss_fn,
        stats_before,
    )


def train_loop(s: Session) -> tuple[int, float]:
    """Steps from ``s.start`` to ``s.steps`` with progress, metrics, periodic eval and checkpoints.

    Returns:
        real tokens processed and seconds spent in the steps.
    """
    plan, cfg, acc = s.spec.plan, s.spec.config, s.accelerator
    rows = len(s.train["input_ids"])
    emit_start(s)
    s.model.train()
    tokens, seconds = 0, 0.0
    for step in range(s.start, s.steps):
        began = time.perf_counter()
        loss = train_step(acc, s.model, s.optimizer, s.scheduler, s.train, step, s.spec, s.loss_fn)
        pairs = s.loss_fn.take_stats(acc) if isinstance(s.loss_fn, preference.PairLoss) else {}
        release_freed_memory(acc, at_most_every_s=TRIM_EVERY_S)
        elapsed = time.perf_counter() - began
        batch = schedule.global_batch_rows(step, rows, plan.global_batch_size, cfg.training.seed)
        step_tokens = int(s.train["real_tokens"][torch.tensor(batch)].sum())
        tokens, seconds = tokens + step_tokens, seconds + elapsed
        s.losses.append(loss)
        lr = s.scheduler.get_last_lr()[0]
        s.log({"train_loss": loss, "lr": lr, "tokens_per_s": step_tokens / elapsed, **pairs}, step + 1)
        emit(
            acc,
            "step",
            step=step + 1,
            steps=s.steps,
            loss=round(loss, 6),
            lr=lr,
            tokens_per_s=round(step_tokens / elapsed, 1),
            elapsed_s=round(seconds, 3),
            **{k: round(v, 6) for k, v in pairs.items()},
        )
        if cfg.training.eval_every and (step + 1) % cfg.training.eval_every == 0 and step + 1 < s.steps:
            s.log(eval_metrics(acc, s.model, s.evals, s.spec, s.loss_fn), step + 1)
        checkpoint_if_due(s, step + 1)
    return tokens, seconds


def finish(s: Session, tokens: int, seconds: float) -> TrainResult:
    """Final eval, outputs, and the result rank 0 writes for the launcher."""
    acc = s.accelerator
    after = eval_metrics(acc, s.model, s.evals, s.spec, s.loss_fn)
    eval_after = after["eval_loss"]
    s.log(after, s.steps)
    pairs = None
    if isinstance(s.loss_fn, preference.PairLoss):
        pairs = {f"{k}_after": v for k, v in after.items() if k != "eval_loss"}
        pairs.update({f"{k}_before": v for k, v in (s.eval_stats_before or {}).items()})
    parity_logps, parity_dtype = training_parity(acc, s.model, s.spec)
    adapter_url, model_url = save_outputs(acc, s.model, s.spec)
    padding_free.report(s.kernels, s.model)
    sequence_parallel.report(s.kernels, s.model)
    losses = s.losses
    result = TrainResult(
        strategy=s.spec.plan.strategy,
        world_size=acc.num_processes,
        backend=torch.distributed.get_backend() if torch.distributed.is_initialized() else "none",
        steps=s.steps,
        resumed_from_step=s.start,
        train_losses=losses,
        train_loss_first=losses[0] if losses else float("nan"),
        train_loss_last=losses[-1] if losses else float("nan"),
        eval_loss_before=s.eval_before,
        eval_loss_after=eval_after,
        real_tokens=tokens,
        tokens_per_s=tokens / seconds if seconds else 0.0,
        train_seconds=seconds,
        adapter_url=adapter_url,
        model_url=model_url,
        sharding=s.sharding,
        peak_memory_mib=peak_memory_mib(acc),
        load_peak_memory_mib=s.load_peak_mib,
        baseline_memory_mib=s.baseline_mib,
        weights_dtype=s.spec.plan.dtype if s.spec.plan.device == "cuda" else "float32",
        preference=pairs,
        parity_logps=parity_logps,
        parity_dtype=parity_dtype,
        kernels=s.kernels,
    )
    return report_done(acc, s.spec, result)


def run(spec: TrainSpec) -> TrainResult:
    session = setup(spec)
    KEPT.append(session)
    tokens, seconds = train_loop(session)
    return finish(session, tokens, seconds)


# torch deprecated the tensor-form collectives that DeepSpeed and FSDP call inside every step. The warning is not
# about ladle's code, and it comes back on each call (the libraries' warning contexts reset Python's once-per-place
# registry): ~150 identical lines per rank in a 6-step ZeRO-3 run, in every Slurm log and failure tail.
LIBRARY_DEPRECATIONS = r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"
# peft reads transformers' deprecated ``is_gradient_checkpointing`` property when it wraps a model (peft_model.py):
# two lines on every rank of every run, about neither ladle's code nor anything a user can change.
PEFT_READS_DEPRECATED = r"`is_gradient_checkpointing` is deprecated"


def main(argv: list[str] | None = None) -> int:
    warnings.filterwarnings("ignore", message=LIBRARY_DEPRECATIONS, category=FutureWarning)
    warnings.filterwarnings("ignore", message=PEFT_READS_DEPRECATED, category=FutureWarning)
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m ladle.train.worker SPEC.json", file=sys.stderr)
        return 2
    spec = TrainSpec.model_validate_json(Path(args[0]).read_text(encoding="utf-8"))
    runner = run
    if spec.config.training.objective == "grpo":  # a step that samples its own data
        from ladle.train import grpo_run

        runner = grpo_run.run
    PREEMPTION.install()  # SIGTERM / SIGUSR1: checkpoint after the step in progress, then exit PREEMPTED
    try:
        runner(spec)
    except Preempted as stop:
        sys.stdout.flush()
        if os.environ.get("LOCAL_RANK", "0") == "0":  # one line per node: its launcher reads it (run_node)
            print(stopped_line(int(os.environ.get("RANK", "0")), stop), file=sys.stderr, flush=True)
        exit_now(PREEMPTED)  # every rank passed the barrier after the checkpoint: nothing left to close
    except Exception as exc:
        # One line the launcher can lead its error with, instead of the launcher's own traceback.
        rank = os.environ.get("RANK", "0")
        sys.stdout.flush()
        error = f"{type(exc).__name__}: {exc}"[:3000]  # keeps the line whole (see write_line)
        write_line(PROGRESS_PREFIX + json.dumps({"event": "error", "rank": int(rank), "error": error}))
        raise
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


def exit_now(code: int) -> NoReturn:
    """End the rank without the interpreter's teardown: everything it wrote is closed and flushed by then
    (checkpoints, outputs, the result file, MLflow's synchronous calls); the teardown of torch and its thread
    pools would cost ~1.3 s per rank, and freeing the session's process groups can deadlock (``KEPT``)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code if 0 <= code < 256 else 1)


if __name__ == "__main__":
    try:
        exit_now(main())
    except SystemExit as exc:
        exit_now(exc.code if isinstance(exc.code, int) else 1)
    except BaseException:  # printed as an uncaught exception would be; the rank ends inside the handler, so
        traceback.print_exc()  # the traceback's frames (and the objects they hold) are never freed
        exit_now(1)
