"""What every objective's rank program shares (``ladle.train.worker`` for sft and dpo, ``ladle.train.grpo_run`` for
grpo): progress lines, the model as loaded (+LoRA) and its optimizer and schedule, the one-rank process group,
MLflow logging, outputs, memory accounting on the host, and the session kept until the rank ends."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from accelerate import Accelerator

from ladle.platform import storage
from ladle.train import checkpoint, kernels, loading, preference, saving
from ladle.train.runtime.base import inner, runtime_for
from ladle.train.spec import PROGRESS_PREFIX, TrainSpec


def emit(accelerator: Accelerator, event: str, **fields) -> None:
    """Print one JSON progress line from rank 0 (the launcher relays it)."""
    if accelerator.is_main_process:
        write_line(PROGRESS_PREFIX + json.dumps({"event": event, **fields}))


# Every rank shares the launcher's pipe: a line written in one call of at most PIPE_BUF (4096) bytes
# arrives whole, never interleaved with another rank's line.
LINE_MAX = 4000


def write_line(line: str) -> None:
    sys.stdout.flush()  # whatever was printed before goes first
    data = (line + "\n").encode("utf-8")
    os.write(sys.stdout.fileno(), data if len(data) <= LINE_MAX else data[: LINE_MAX - 1] + b"\n")


def load_model(spec: TrainSpec, accelerator: Accelerator):
    """The base (+LoRA via peft), and what it still needs loaded.

    Strategies that load lazily get an empty skeleton (``loading``) and a ``Pending`` that their ``wrap``
    fills once the model is sharded or split, so each rank reads only what it holds. A 4-bit base goes
    through ``from_pretrained`` (bitsandbytes quantizes while loading), as does a strategy whose own
    loading arguments shard it (tensor parallel); those return no ``Pending``.
    """
    from transformers import AutoModelForCausalLM

    cfg, plan = spec.config, spec.plan
    runtime = runtime_for(plan.strategy)
    dtype = loading.run_dtype(plan)
    quantized = cfg.training.quantization.mode == "nf4"
    pending = None
    if runtime.strategy.loads_lazily and not quantized:
        model, pending = loading.skeleton(spec.base_dir, plan, runtime)
    else:
        kwargs = {"dtype": dtype, **runtime.load_kwargs(accelerator, plan)}
        if quantized:
            from transformers import BitsAndBytesConfig

            storage_dtype = cfg.training.quantization.storage_dtype
            if storage_dtype == "auto":  # sharded tensors must be floats; otherwise bitsandbytes' packed uint8
                storage_dtype = plan.dtype if runtime.strategy.shards_tensors else "uint8"
            kwargs["quantization_config"] = BitsAndBytesConfig(
                load_in_4bit=True,
                bnb_4bit_quant_type="nf4",
                bnb_4bit_compute_dtype=dtype,
                bnb_4bit_quant_storage=getattr(torch, storage_dtype),
            )
        model = AutoModelForCausalLM.from_pretrained(spec.base_dir, **kwargs)
    model.config.use_cache = False
    ran = {"liger": kernels.apply_liger(model, plan.kernels, plan.device)}
    if plan.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    recomputes = getattr(model, "is_gradient_checkpointing", False)  # what the model says it does, not the plan
    ran["checkpointing"] = "activations recomputed in backward" if recomputes else "off"
    if cfg.training.lora.enabled:
        from peft import LoraConfig, get_peft_model

        lora = cfg.training.lora
        model = get_peft_model(
            model,
            LoraConfig(
                r=lora.r,
                lora_alpha=lora.alpha,
                lora_dropout=lora.dropout,
                target_modules=lora.target_modules,
                modules_to_save=lora.modules_to_save or None,
                task_type="CAUSAL_LM",
            ),
        )
        loading.init_adapters(model, cfg.training.seed)
        ran["lora_compute"] = kernels.lora_in_run_dtype(model, plan.kernels, plan.strategy, plan.device)
    if cfg.training.objective in ("dpo", "kto") and cfg.training.preference.disable_dropout:
        ran["dropout"] = preference.disable_dropout(model)  # before compiling: the graphs see p = 0
    ran["compile"] = kernels.compile_blocks(model, plan.kernels, plan.strategy)
    if pending is not None:
        pending.values = loading.kept_values(model)
    return model, pending, ran


def build_optimizer(model, cfg) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters (after any sharding, so it holds shards)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=cfg.training.lr, weight_decay=cfg.training.weight_decay)


def build_scheduler(optimizer, cfg, steps: int):
    from transformers import get_scheduler

    name = "constant_with_warmup" if cfg.training.scheduler == "constant" else cfg.training.scheduler
    return get_scheduler(name, inner(optimizer), num_warmup_steps=cfg.training.warmup_steps, num_training_steps=steps)


class NonFiniteLoss(RuntimeError):
    """A step's loss was NaN or infinite: the run stops before applying it."""


def mlflow_logger(spec: TrainSpec, accelerator: Accelerator):
    """A ``log(metrics, step)`` callable for rank 0; a no-op elsewhere or without a run."""
    if not (accelerator.is_main_process and spec.mlflow_run_id and spec.tracking_uri):
        return lambda metrics, step: None
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    client = MlflowClient(spec.tracking_uri)

    def log(metrics: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        client.log_batch(spec.mlflow_run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()])

    return log


def save_outputs(accelerator, model, spec: TrainSpec) -> tuple[str | None, str | None]:
    """Rank 0 writes the adapter (LoRA) or the full model, with the tokenizer, then marks it complete."""
    from transformers import AutoTokenizer

    runtime = runtime_for(spec.plan.strategy)
    unwrapped = runtime.hf_model(accelerator, model)
    kind = "adapter" if spec.config.training.lora.enabled else "model"
    url = storage.join(spec.run_url, kind)
    main = accelerator.is_main_process
    # Collective: every rank takes part in gathering sharded parameters; rank 0 receives the full tensors.
    with tempfile.TemporaryDirectory() as tmp:
        if kind == "adapter":
            full = runtime.full_state_dict(accelerator, model, trainable_only=True)
            if main:
                unwrapped.save_pretrained(tmp, state_dict=full, safe_serialization=True)
        else:  # a part at a time: rank 0 never holds the whole model beside its states
            shard_bytes = spec.config.training.save_shard_mib * 2**20
            parts = runtime.full_model_parts(accelerator, model, shard_bytes)
            saving.write_model_files(unwrapped, parts, Path(tmp), shard_bytes, main)
        if main:
            AutoTokenizer.from_pretrained(spec.base_dir).save_pretrained(tmp)
            if kind == "adapter":  # which base it was trained on: a server of another base refuses it
                from ladle.serve.adapters import write_record

                write_record(Path(tmp), Path(spec.base_dir), spec.config.base)
            storage.remove(url)
            storage.upload_dir(tmp, url)
    accelerator.wait_for_everyone()
    return (url, None) if kind == "adapter" else (None, url)


def one_process_group(plan) -> None:
    """A process group of one rank for a one-process run.

    ``accelerate launch`` starts a single process without torchrun (it refuses ``--multi_gpu`` for one), so
    nothing creates a process group, yet DeepSpeed's engine (``dist_init_required=False``) and FSDP2's device
    mesh need one even alone: without it every strategy but DDP failed on one GPU (or one CPU process). The
    group meets on a local TCP store (torchrun's variables, unless the environment has them), NCCL on a GPU and
    gloo on a CPU as the plan's backend says, so a one-rank run goes through the same code as N ranks do.
    """
    if plan.world_size != 1 or torch.distributed.is_initialized():
        return
    from ladle.platform.processes import free_port

    # torchrun's variables, as the N-rank launch sets them: DeepSpeed reads LOCAL_RANK and RANK itself.
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1")):
        os.environ.setdefault(name, value)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    if plan.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.distributed.init_process_group(plan.backend, init_method="env://", rank=0, world_size=1)


def warm_imports(runtime) -> None:
    """Import what loading and wrapping will, so the baseline measured next includes the libraries."""
    import peft  # noqa: F401
    import transformers.models.auto.modeling_auto  # noqa: F401

    if runtime.strategy.engine == "deepspeed":
        from ladle.strategies.deepspeed_import import import_deepspeed

        import_deepspeed()


def release_freed_memory(accelerator: Accelerator, at_most_every_s: float = 0.0) -> None:
    """On CPU runs, hand freed heap pages back to the system at phase boundaries (load, eval, steps).

    A step's many sub-4 MiB activations and gathered shards come from glibc's heap; once freed, the holes
    between live blocks stay resident, so the next phase's peak lands on top of them. Measured on a 0.38B
    ZeRO-3 LoRA rank: 650 MiB resident after a step that ``malloc_trim(0)`` returns. The next step then
    faults its pages in again: after every step of the tiny demo model that cost 25 % of its tokens/s, so
    steps trim at most every ``TRIM_EVERY_S`` (every step of a model whose steps take longer).
    GPU runs allocate on the device; other C libraries have no malloc_trim and keep their behaviour."""
    if accelerator.device.type != "cpu" or TRIM is None:
        return
    now = time.monotonic()
    if now - LAST_TRIM[0] < at_most_every_s:
        return
    TRIM(0)
    LAST_TRIM[0] = time.monotonic()


def _malloc_trim():
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


TRIM = _malloc_trim()


TRIM_EVERY_S = 5.0


LAST_TRIM = [0.0]


def peak_memory_mib(accelerator: Accelerator) -> float:
    """Largest per-rank peak: CUDA allocator peak on GPUs, resident set size on CPU."""
    if accelerator.device.type == "cuda":
        mine = torch.cuda.max_memory_allocated(accelerator.device) / 2**20
    else:
        import resource

        mine = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    value = torch.tensor([mine], dtype=torch.float64, device=accelerator.device)
    return float(accelerator.reduce(value, reduction="max")[0]) if accelerator.num_processes > 1 else mine


KEPT: list = []
"""The rank's training session, held until the process ends with ``os._exit`` (no teardown). Freeing it mid-way
can deadlock the rank: DDP's reducer holds a gloo process group, whose destructor joins the group's run-loop
thread while holding the GIL, and that thread may still be destroying its last collective's work, which releases
Python tensors and so waits for the GIL (seen under load: rank 1 stuck in ``~ProcessGroupGloo`` -> ``join``, the
run loop in ``~AsyncAllreduceWork`` -> ``gil_scoped_acquire``, after rank 0 had finished)."""


def emit_start(session) -> None:
    """The run's ``start`` line (``session``: either objective's: ``Session`` or ``RLSession``)."""
    acc = session.accelerator
    emit(
        acc,
        "start",
        steps=session.steps,
        world_size=acc.num_processes,
        resumed_from=session.start,
        strategy=session.spec.plan.strategy,
        backend=str(acc.state.distributed_type),
        kernels=session.kernels,
        threads=torch.get_num_threads(),  # each rank's intra-op threads (OMP_NUM_THREADS on CPU)
        eval_loss=session.eval_before,
    )


def checkpoint_if_due(session, steps_done: int) -> None:
    """Write a resumable checkpoint after ``steps_done`` steps when ``training.checkpoint_every`` says so, or when
    any rank was told to stop (``ladle.train.preempt``: the checkpoint, then ``Preempted``). Collective: every
    rank calls it after every step."""
    from ladle.train.preempt import PREEMPTION, Preempted

    every = session.spec.config.training.checkpoint_every
    due = bool(every) and steps_done % every == 0
    if due:
        save_checkpoint(session, steps_done)
    told = PREEMPTION.agreed(session.accelerator)
    if told is None:
        return
    if not due:
        save_checkpoint(session, steps_done)
    waited = time.monotonic() - PREEMPTION.at if PREEMPTION.at is not None else 0.0
    emit(session.accelerator, "preempted", step=steps_done, signal=told, seconds_since_signal=round(waited, 3))
    session.accelerator.wait_for_everyone()
    raise Preempted(steps_done, told)


def save_checkpoint(session, steps_done: int) -> None:
    """The resumable checkpoint of ``steps_done`` steps (collective)."""
    plan = session.spec.plan
    checkpoint.save(
        session.accelerator,
        storage.join(session.spec.run_url, "checkpoints"),
        steps_done,
        session.model,
        session.optimizer,
        session.scheduler,
        session.losses,
        session.eval_before,
        plan,
        runtime_for(plan.strategy),
        extra=session.resume_extra() if hasattr(session, "resume_extra") else None,
    )


def report_done(accelerator: Accelerator, spec: TrainSpec, result):
    """Rank 0 writes ``result`` where the launcher reads it and prints the ``done`` line; every rank then waits for
    the others and ends the run. Returns ``result``."""
    if accelerator.is_main_process:
        storage.write_json(storage.join(spec.run_url, "train_result.json"), result.model_dump())
    emit(accelerator, "done", **result.model_dump(exclude={"train_losses"}))
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return result


def training_parity(acc, model, spec: TrainSpec) -> tuple[list[list[float]] | None, str]:
    """Each parity probe row's per-token log-probabilities (``ladle.lifecycle.parity``; position i: of token i
    given those before, 0 for the first) by the model as trained, in the training process, and the dtype that
    forward computed in; every rank runs every forward (a sharded forward is a collective). None without rows, or
    when the strategy splits one forward over ranks (pipeline, sequence parallel): the deploy stage then compares
    with the saved weights.

    Where mixed precision is accelerate's autocast around float32 master weights (a 16-bit run under DDP, ZeRO-less
    strategies, on a CPU or a GPU), the forward runs without it: the weights as they are, which the merge writes
    and the server runs, so the comparison is float32's (1e-4), not autocast's rounding (about 3e-3 per token on
    SmolLM2 under CPU bf16) against float32. Strategies that hold or compute 16-bit weights themselves keep it."""
    from ladle import strategies

    strategy = strategies.get(spec.plan.strategy)
    computes = spec.plan.dtype
    if not spec.parity_probe or not strategy.runs_whole_forward(strategy.options(spec.config)):
        return None, computes
    inner = getattr(model, "module", model)
    original = inner.__dict__.get("_original_forward")  # accelerate's forward before its autocast wrapper
    wrapped = inner.__dict__.get("forward")
    if strategy.autocast and original is not None and all(p.dtype == torch.float32 for p in inner.parameters()):
        inner.forward, computes = original, "float32"
    was_training = model.training
    model.eval()
    found = []
    try:
        with torch.no_grad():
            for row in spec.parity_probe:
                ids = torch.tensor([row["ids"]], device=acc.device)
                positions = torch.arange(len(row["ids"]), device=acc.device)[None]
                keep = torch.ones((1, len(row["ids"]) - 1), dtype=torch.bool, device=acc.device)
                logps = preference.token_logps(model, ids, ids, positions, keep)
                found.append([0.0, *logps.float().cpu().tolist()])
    finally:
        if wrapped is not None:
            inner.forward = wrapped
        model.train(was_training)
    return found, computes
