"""Validate the config against the machine and decide how to train.

Every problem is collected and reported in one error before any process starts.
The plan carries its reasons: each derived value says where it came from, and
each explicit setting that won over a derived one is listed as an override.
"""

from __future__ import annotations

import os
import shlex
import sys
from typing import Any, Literal

from pydantic import BaseModel, Field

from ladle import strategies
from ladle.config import LadleConfig
from ladle.errors import ConfigError, LadleError
from ladle.topology import Topology

DEFAULT_PORT = 29500


class Plan(BaseModel):
    strategy: str
    strategy_options: dict[str, Any] = Field(default_factory=dict)
    launcher_config: dict[str, Any] = Field(
        default_factory=dict, description="The strategy's rendered launcher config (the DeepSpeed JSON for ZeRO)."
    )
    device: Literal["cpu", "cuda"]
    backend: Literal["gloo", "nccl"]
    world_size: int = Field(description="Training processes in all.")
    num_machines: int = 1
    processes_per_machine: int
    main_address: str = "127.0.0.1"
    main_port: int = Field(0, description="Rendezvous port; 0: pick a free one at launch (single machine).")
    micro_batch_size: int
    gradient_accumulation: int
    global_batch_size: int = Field(description="Packed rows per optimizer step across all ranks.")
    dtype: Literal["float32", "bfloat16", "float16"]
    reasons: list[str] = Field(default_factory=list, description="Why each decision was made.")
    overrides: list[str] = Field(default_factory=list, description="Explicit settings that won.")
    warnings: list[str] = Field(default_factory=list)
    candidates: list[dict[str, Any]] = Field(
        default_factory=list,
        description="Every strategy the sizing considered, fastest first: per-rank memory, whether it fits, why.",
    )

    def launcher_argv(
        self, worker_args: list[str], port: int = DEFAULT_PORT, python: str | None = None, machine_rank: int = 0
    ) -> list[str]:
        """The ``accelerate launch`` argv that starts this machine's training processes (a list, never a shell string).

        Across machines, torchrun's static rendezvous meets at ``main_address:main_port`` (a c10d TCP
        store on node 0) and ``machine_rank`` fixes each node's ranks, so global rank 0, which logs
        and writes, is always on node 0 where the pipeline relays its progress.
        """
        strategy = strategies.get(self.strategy)
        mixed = {"float32": "no", "bfloat16": "bf16", "float16": "fp16"}[self.dtype]
        return [
            python or sys.executable,
            "-m",
            "accelerate.commands.launch",
            *strategy.launcher_args(self),
            "--num_processes",
            str(self.world_size),
            "--num_machines",
            str(self.num_machines),
            "--machine_rank",
            str(machine_rank),
            "--main_process_ip",
            self.main_address,
            "--main_process_port",
            str(self.main_port or port),
            "--mixed_precision",
            mixed,
            "--dynamo_backend",
            "no",
            "-m",
            "ladle.train.worker",
            *worker_args,
        ]

    def launch_command(self, worker_args: list[str], port: int = DEFAULT_PORT) -> str:
        """The launch argv as a command a user can paste."""
        argv = self.launcher_argv(worker_args, port)
        return shlex.join(["accelerate", "launch", *argv[3:]])

    def to_markdown(self) -> str:
        rows = [
            ("strategy", self.strategy),
            ("device", f"{self.device} ({self.backend})"),
            ("world size", f"{self.world_size} = {self.num_machines} machine(s) x {self.processes_per_machine}"),
            (
                "batch",
                f"{self.global_batch_size} rows/step = {self.micro_batch_size} micro x "
                f"{self.world_size} ranks x {self.gradient_accumulation} accumulation",
            ),
            ("dtype", self.dtype),
        ]
        lines = ["# Training plan", "", "| decision | value |", "| --- | --- |"]
        lines += [f"| {k} | {v} |" for k, v in rows]
        for title, items in (("Reasons", self.reasons), ("Overrides", self.overrides), ("Warnings", self.warnings)):
            if items:
                lines += ["", f"## {title}", *[f"- {item}" for item in items]]
        if self.candidates:
            lines += [
                "",
                "## Candidates (fastest first)",
                "",
                "| strategy | per rank | fits | why |",
                "| --- | --- | --- | --- |",
            ]
            lines += [
                f"| {c['strategy']} | {c['breakdown']} | {'yes' if c['fits'] else 'no'} | {c['why']} |"
                for c in self.candidates
            ]
        if self.launcher_config:
            import json

            lines += [
                "",
                f"## {self.strategy} launcher config",
                "",
                "```json",
                json.dumps(self.launcher_config, indent=2),
                "```",
            ]
        return "\n".join(lines) + "\n"


def check_inputs(cfg: LadleConfig) -> dict:
    """The base holds a model and every data source holds a record (cheap reads only); returns the
    base's ``config.json`` for sizing.

    Shared by the CLI (before Prefect starts) and the validate task (for deployments).

    Raises:
        LadleError: naming the field, the value and the fix.
    """
    from ladle.assets import resolve_base
    from ladle.data.prepare import check_not_empty
    from ladle.params import read_config

    base = resolve_base(cfg.base)
    check_not_empty(cfg.data.path)
    if cfg.data.eval_path:
        check_not_empty(cfg.data.eval_path, "data.eval_path")
    return read_config(base)


def local_model_config(cfg: LadleConfig, override: str | None = None) -> dict | None:
    """``--model-config``, else the base's config.json when it is already on this machine (nothing is created
    or downloaded: planning stays fast); None when neither is at hand."""
    from pathlib import Path

    from ladle.assets import ASSET_VERSION, BUILTIN_SCHEME, MODEL_CONFIGS, ladle_home, resolve_builtin
    from ladle.params import read_config

    if override:
        return read_config(override)
    base = cfg.base
    if base.startswith(BUILTIN_SCHEME + MODEL_CONFIGS):
        base = resolve_builtin(base, "base")
    elif base.startswith(BUILTIN_SCHEME):
        base = str(ladle_home() / "assets" / f"{base.removeprefix(BUILTIN_SCHEME)}-{ASSET_VERSION}")
    return read_config(base) if Path(base, "config.json").is_file() else None


def make_plan(cfg: LadleConfig, topo: Topology, config_ref: str = "CONFIG", model: dict | None = None) -> Plan:
    """Decide world size, strategy, batch layout and dtype for ``cfg`` on ``topo``.

    ``model`` is the base's ``config.json``; with it the strategy is sized by the memory model
    (``ladle.sizing``), without it ``auto`` means DDP and the plan says the size was unknown.

    Raises:
        ConfigError: every problem found, each with its field, value and fix.
    """
    problems: list[str] = []
    reasons: list[str] = []
    overrides: list[str] = []
    warnings = list(topo.warnings)
    device, per_machine = choose_world(cfg, topo, config_ref, problems, reasons, warnings)
    nodes = choose_nodes(cfg, topo, problems, reasons)
    world = per_machine * nodes
    dtype = choose_dtype(cfg, topo, device, [], [])
    candidates: list[dict] = []
    strategy, adjust = choose_strategy(
        cfg, topo, device, per_machine, nodes, dtype, model, reasons, overrides, warnings, problems, candidates
    )
    if adjust:  # settings the sizing chose (recorded in the reasons); the caller's config is left as it was
        cfg = cfg.model_copy(deep=True)
        for section, field, value in adjust:
            setattr(getattr(cfg.parallelism, section), field, value)
    if (
        strategy == "pipeline"
        and device == "cuda"
        and cfg.parallelism.gpus == "auto"
        and per_machine > cfg.parallelism.pipeline.stages
    ):
        per_machine = world = cfg.parallelism.pipeline.stages
        reasons.append(f"{per_machine} process(es): --gpus auto adapts to one pipeline of {per_machine} stages")
    problems += strategies.get(strategy).validate(cfg, topo, world)
    if model is not None:
        problems += strategies.get(strategy).validate_model(model, world)
    if cfg.parallelism.fsdp2.compile and strategy != "fsdp2":
        what = (
            "DeepSpeed with torch.compile is rejected (its engine hooks break under compiled graphs)"
            if strategy.startswith("zero")
            else f"compile is wired for fsdp2 only, not {strategy}"
        )
        problems.append(
            f"parallelism.fsdp2.compile = true with parallelism.strategy = {strategy}: {what}. "
            "Set parallelism.strategy=fsdp2 or parallelism.fsdp2.compile=false."
        )
    replicas = 1 if strategy in ("pipeline", "tp") else world  # a pipeline's or tp group's ranks share one batch
    micro = choose_micro(cfg, topo, device, per_machine, nodes, dtype, model, strategy, replicas, reasons, warnings)
    # With no global batch asked for, one pipeline gets one microbatch per stage (what 1F1B needs to fill it).
    fill = cfg.parallelism.pipeline.stages if strategy == "pipeline" else 1
    micro, accum, global_batch = choose_batch(cfg, micro, replicas, problems, reasons, default_accumulation=fill)
    if (
        strategy == "pipeline"
        and cfg.parallelism.pipeline.schedule == "1f1b"
        and accum < cfg.parallelism.pipeline.stages
    ):
        problems.append(
            f"training.global_batch_size = {global_batch}: 1f1b needs at least one microbatch per stage "
            f"({accum} < {cfg.parallelism.pipeline.stages}). Use global_batch_size="
            f"{micro * cfg.parallelism.pipeline.stages} or more, or parallelism.pipeline.schedule=gpipe."
        )
    dtype = choose_dtype(cfg, topo, device, problems, reasons)
    problems += check_device_features(cfg, device)
    if problems:
        # What was decided so far travels with the error: `ladle plan --json` shows why nothing fits.
        raise ConfigError(
            problems,
            details={
                "device": device,
                "world_size": world,
                "dtype": dtype,
                "reasons": reasons,
                "warnings": warnings,
                "candidates": candidates,
            },
        )
    plan = Plan(
        strategy=strategy,
        strategy_options=strategy_options(cfg, strategy),
        device=device,
        backend="nccl" if device == "cuda" else "gloo",
        world_size=world,
        num_machines=nodes,
        processes_per_machine=per_machine,
        main_address=cfg.parallelism.main_address,
        main_port=cfg.parallelism.main_port,
        micro_batch_size=micro,
        gradient_accumulation=accum,
        global_batch_size=global_batch,
        dtype=dtype,
        reasons=reasons,
        overrides=overrides,
        warnings=warnings,
        candidates=candidates,
    )
    plan.launcher_config, resolved = strategies.get(strategy).configure(cfg, plan)
    plan.reasons += resolved
    return plan


def choose_nodes(cfg, topo, problems, reasons) -> int:
    """Machines taking part: the config's ``parallelism.nodes``, else the launcher environment's."""
    nodes = cfg.parallelism.nodes if cfg.parallelism.nodes > 1 else topo.nodes
    if nodes > 1:
        if cfg.parallelism.main_port == 0:
            problems.append(
                f"parallelism.main_port = 0: a {nodes}-node run needs a fixed rendezvous port that every node "
                "can reach. Set parallelism.main_port (e.g. 29500) and parallelism.main_address."
            )
        reasons.append(f"{nodes} nodes: rendezvous at {cfg.parallelism.main_address}:{cfg.parallelism.main_port}")
    return nodes


def choose_world(cfg, topo, config_ref, problems, reasons, warnings) -> tuple[str, int]:
    """Device and processes per machine."""
    gpus = cfg.parallelism.gpus
    if topo.gpu_count == 0:
        procs = cfg.parallelism.cpu_processes
        if gpus != "auto":
            fixed = shlex.join(["ladle", "run", config_ref, "--gpus", "auto"])
            problems.append(
                f"parallelism.gpus = {gpus}: this host has no CUDA GPU (nvidia-smi found none). "
                f"Run on a GPU host, or train on CPU with: {fixed}"
            )
        warnings.append(
            f"--gpus auto found no GPU: planning a CPU run of {procs} gloo process(es) (parallelism.cpu_processes)"
        )
        reasons.append(f"{procs} process(es) per machine: CPU host, parallelism.cpu_processes={procs}")
        return "cpu", procs
    if gpus == "auto":
        reasons.append(
            f"{topo.gpu_count} process(es) per machine: --gpus auto uses all {topo.gpu_count} visible GPU(s)"
        )
        return "cuda", topo.gpu_count
    if gpus > topo.gpu_count:
        fixed = shlex.join(["ladle", "run", config_ref, "--gpus", str(topo.gpu_count)])
        problems.append(
            f"parallelism.gpus = {gpus}: this host has {topo.gpu_count} visible GPU(s). "
            f"Ask for at most {topo.gpu_count}, e.g.: {fixed} (or --gpus auto)"
        )
    reasons.append(f"{gpus} process(es) per machine: --gpus {gpus} (of {topo.gpu_count} visible)")
    return "cuda", gpus


def strategy_options(cfg: LadleConfig, strategy: str) -> dict:
    section = strategies.options_section(strategy)
    return getattr(cfg.parallelism, section).model_dump() if section else {}


def device_bytes(topo: Topology, device: str, per_machine: int) -> int | None:
    """Memory one rank may use: its GPU's (the smallest visible), or on CPU the host's RAM shared by the processes."""
    if device == "cuda":
        sizes = [g.memory_mib for g in topo.gpus if g.memory_mib]
        return min(sizes) * 2**20 if sizes else None
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // per_machine
    except (ValueError, OSError, AttributeError):
        return None


def sizing_job(cfg: LadleConfig, model: dict, per_machine: int, nodes: int, dtype: str, micro: int, device: str):
    from ladle import params, sizing

    lora = cfg.training.lora
    trainable = params.lora_params(model, lora.r, lora.target_modules) if lora.enabled else None
    shape = sizing.shape_from_config(model, trainable)
    return sizing.Job(
        shape=shape,
        lora=lora.enabled,
        qlora=cfg.training.quantization.mode != "none",
        micro_batch=micro,
        seq_len=cfg.data.seq_len,
        dtype_bytes=4 if dtype == "float32" else 2,
        checkpointing=cfg.training.gradient_checkpointing,
        gpus_per_node=per_machine,
        nodes=nodes,
        microbatches=max(1, (cfg.training.global_batch_size or micro * per_machine * nodes) // micro),
        cuda=device == "cuda",
    )


def choose_strategy(
    cfg, topo, device, per_machine, nodes, dtype, model, reasons, overrides, warnings, problems, candidates
) -> tuple[str, list]:
    """The explicit strategy, or the fastest candidate that fits with headroom (every candidate recorded),
    and the ``(section, field, value)`` settings that candidate needs."""
    from ladle import sizing

    explicit = cfg.parallelism.strategy
    if explicit != "auto":
        overrides.append(f"parallelism.strategy = {explicit} (explicit)")
    capacity = device_bytes(topo, device, per_machine)
    if model is None or capacity is None:
        missing = (
            "model size unknown (no config.json at hand: a local base folder, or --model-config)"
            if model is None
            else "device memory unknown (pass --gpu-memory with --topology-file)"
        )
        if explicit == "auto":
            reasons.append(f"strategy ddp: {missing}, so the default with the least communication")
        return (explicit if explicit != "auto" else "ddp"), []
    try:
        micro = 1 if cfg.training.micro_batch_size == "auto" else cfg.training.micro_batch_size
        job = sizing_job(cfg, model, per_machine, nodes, dtype, micro, device)
    except LadleError as err:
        warnings.append(f"memory not sized: {err}")
        return (explicit if explicit != "auto" else "ddp"), []
    chosen = None
    for name, offload, why in sizing.preference(job, topo.interconnect):
        if name == "pipeline" and not pipeline_possible(cfg, job, device):
            continue
        if offload and device != "cuda":
            continue
        est = sizing.estimate(job, name, offload)
        fits = est.fits(capacity)
        candidates.append(
            {
                "strategy": est.strategy,
                "per_rank_gib": round(est.total / sizing.GIB, 2),
                "fits": fits,
                "breakdown": est.summary(),
                "why": why,
            }
        )
        if fits and chosen is None:
            chosen = (name.removesuffix("+hsdp"), offload, why, est)
    limit = f"{sizing.gib(sizing.HEADROOM * capacity)} usable of {sizing.gib(capacity)} per rank"
    if explicit != "auto":
        mine = next((c for c in candidates if c["strategy"] == explicit), None)
        ds, fsdp = cfg.parallelism.deepspeed, cfg.parallelism.fsdp2
        offloads = (
            (fsdp.cpu_offload, fsdp.cpu_offload)
            if explicit == "fsdp2"
            else (ds.offload_optimizer != "none", ds.offload_param != "none")
            if explicit.startswith("zero")
            else (False, False)
        )
        if mine is None or any(offloads):
            mine_est = sizing.estimate(job, explicit, *offloads)
            mine = {
                "strategy": mine_est.strategy,
                "per_rank_gib": round(mine_est.total / sizing.GIB, 2),
                "fits": mine_est.fits(capacity),
                "breakdown": mine_est.summary(),
                "why": "explicit",
            }
            candidates.insert(0, mine)
        if not mine["fits"]:
            better = f"; {chosen[0]} would fit ({chosen[3].summary()})" if chosen else ""
            warnings.append(f"parallelism.strategy = {explicit} needs {mine['breakdown']}, more than {limit}{better}")
        else:
            reasons.append(f"strategy {explicit} (explicit): needs {mine['breakdown']}, within {limit}")
        return explicit, []
    if chosen is None:
        smallest = min(candidates, key=lambda c: c["per_rank_gib"])
        problems.append(
            f"parallelism.strategy = auto: no strategy fits {limit}; the smallest is {smallest['strategy']} at "
            f"{smallest['breakdown']}. Train fewer weights (training.lora.enabled=true, or QLoRA with "
            "training.quantization.mode=nf4), set training.gradient_checkpointing=true, lower "
            "training.micro_batch_size or data.seq_len, or add GPUs/nodes."
        )
        return "ddp", []
    name, offload, why, est = chosen  # name: the strategy (fsdp2+hsdp runs as fsdp2 with replicate groups)
    slower = [c["strategy"] for c in candidates[: candidates.index(next(c for c in candidates if c["fits"]))]]
    skipped = f"; faster {', '.join(slower)} do not fit" if slower else ""
    reasons.append(f"strategy {est.strategy}: {why}; needs {est.summary()}, within {limit}{skipped}")
    adjust = []
    if offload:
        warnings.append(f"{name} with optimizer offload: the optimizer step runs on the host (slow)")
        adjust.append(("deepspeed", "offload_optimizer", "cpu"))
    if est.strategy.startswith("fsdp2+hsdp"):
        adjust.append(("fsdp2", "replicate", 0))
    if name == "pipeline":
        adjust.append(("pipeline", "stages", job.world))
        reasons.append(f"pipeline of {job.world} stages: one per process")
    return name, adjust


def pipeline_possible(cfg, job, device) -> bool:
    return (
        2 <= job.world <= 16
        and job.shape.layers >= job.world
        and (device == "cuda" or cfg.parallelism.pipeline.allow_cpu)
    )


MICRO_CHOICES = (64, 32, 16, 8, 4, 2, 1)


def choose_micro(cfg, topo, device, per_machine, nodes, dtype, model, strategy, replicas, reasons, warnings) -> int:
    """``training.micro_batch_size``, or for ``auto`` the largest that fits the chosen strategy and divides the batch."""
    from ladle import sizing

    asked = cfg.training.micro_batch_size
    if asked != "auto":
        return asked
    capacity = device_bytes(topo, device, per_machine)
    wanted = cfg.training.global_batch_size
    if model is None or capacity is None:
        reasons.append("micro-batch 1: auto, but the model size or device memory is unknown")
        return 1
    ds, fsdp = cfg.parallelism.deepspeed, cfg.parallelism.fsdp2
    label = strategy + ("+hsdp" if strategy == "fsdp2" and fsdp.replicate != 1 else "")
    offloads = (
        (fsdp.cpu_offload, fsdp.cpu_offload)
        if strategy == "fsdp2"
        else (ds.offload_optimizer != "none", ds.offload_param != "none")
        if strategy.startswith("zero")
        else (False, False)
    )
    for micro in MICRO_CHOICES:
        if wanted and wanted % (micro * replicas):
            continue
        est = sizing.estimate(sizing_job(cfg, model, per_machine, nodes, dtype, micro, device), label, *offloads)
        if est.fits(capacity):
            divides = f" and divides the global batch {wanted}" if wanted else ""
            reasons.append(
                f"micro-batch {micro}: the largest of {'/'.join(map(str, MICRO_CHOICES))} that fits "
                f"({est.summary()}){divides}"
            )
            return micro
    warnings.append("micro-batch 1: auto found no micro-batch that fits; even 1 row per process exceeds the device")
    return 1


def choose_batch(cfg, micro, world, problems, reasons, default_accumulation: int = 1) -> tuple[int, int, int]:
    """Accumulation (pipeline: microbatches per step) and global batch for ``world`` data-parallel replicas."""
    per_step = micro * world
    wanted = cfg.training.global_batch_size or per_step * default_accumulation
    if wanted % per_step:
        lower, upper = max(per_step, wanted // per_step * per_step), (wanted // per_step + 1) * per_step
        problems.append(
            f"training.global_batch_size = {wanted}: not a multiple of micro_batch_size x data-parallel ranks "
            f"({micro} x {world} = {per_step}). Use {lower} or {upper}."
        )
        return micro, 1, wanted
    accum = wanted // per_step
    reasons.append(f"gradient accumulation {accum}: global batch {wanted} / ({micro} micro x {world} ranks)")
    return micro, accum, wanted


def choose_dtype(cfg, topo, device, problems, reasons) -> str:
    asked = cfg.training.dtype
    if device == "cpu":
        if asked == "float16":
            problems.append("training.dtype = float16: float16 training needs CUDA. Use float32 or bfloat16 on CPU.")
        dtype = "float32" if asked == "auto" else asked
        reasons.append(f"dtype {dtype}: CPU run" + (" (auto)" if asked == "auto" else " (explicit)"))
        return dtype
    if asked != "auto":
        return asked
    caps = [float(g.compute_capability or 0) for g in topo.gpus]
    dtype = "bfloat16" if caps and min(caps) >= 8.0 else "float16"
    reasons.append(f"dtype {dtype}: lowest compute capability {min(caps) if caps else 'unknown'} (bf16 needs >= 8.0)")
    return dtype


def check_device_features(cfg: LadleConfig, device: str) -> list[str]:
    """Features that need CUDA, checked before anything starts."""
    problems = []
    if device == "cpu" and cfg.training.quantization.mode != "none":
        problems.append(
            f"training.quantization.mode = {cfg.training.quantization.mode}: 4-bit QLoRA needs CUDA and "
            "bitsandbytes; this host has no GPU. Set training.quantization.mode=none or run on a GPU host."
        )
    if device == "cpu" and cfg.serve.backend == "mii":
        problems.append(
            "serve.backend = mii: DeepSpeed-MII has no CPU path and this host has no CUDA GPU. "
            "Use serve.backend=transformers or deploy on a GPU host."
        )
    if cfg.output.startswith("memory://"):
        problems.append(
            f"output = {cfg.output}: training runs in separate processes, which cannot see this process's "
            "in-memory filesystem. Use a local folder or an object store URL (s3://...)."
        )
    quant = cfg.training.quantization
    if (
        quant.mode != "none"
        and quant.storage_dtype == "uint8"
        and cfg.parallelism.strategy in ("fsdp2", "zero3", "zero++")
    ):
        problems.append(
            f"training.quantization.storage_dtype = uint8 with parallelism.strategy = {cfg.parallelism.strategy}: "
            "sharding needs the packed 4-bit weights in a float dtype. Set training.quantization.storage_dtype="
            "bfloat16 (or auto)."
        )
    if cfg.training.quantization.mode != "none" and not cfg.training.lora.enabled:
        problems.append(
            f"training.quantization.mode = {cfg.training.quantization.mode}: a 4-bit base cannot be trained "
            "directly. Set training.lora.enabled=true (QLoRA) or quantization.mode=none."
        )
    return problems
