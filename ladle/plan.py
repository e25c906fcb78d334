"""Validate the config against the machine and decide how to train.

Every problem is collected and reported in one error before any process starts.
The plan carries its reasons: each derived value says where it came from, and
each explicit setting that won over a derived one is listed as an override.
"""

from __future__ import annotations

import shlex
import sys
from typing import Any, Literal

from pydantic import BaseModel, Field

from ladle import strategies
from ladle.config import LadleConfig
from ladle.errors import ConfigError
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

    def launcher_argv(self, worker_args: list[str], port: int = DEFAULT_PORT, python: str | None = None,
                      machine_rank: int = 0) -> list[str]:  # fmt: skip
        """The ``accelerate launch`` argv that starts this machine's training processes (a list, never a shell string).

        Across machines, torchrun's static rendezvous meets at ``main_address:main_port`` (a c10d TCP
        store on node 0) and ``machine_rank`` fixes each node's ranks, so global rank 0, which logs
        and writes, is always on node 0 where the pipeline relays its progress.
        """
        strategy = strategies.get(self.strategy)
        mixed = {"float32": "no", "bfloat16": "bf16", "float16": "fp16"}[self.dtype]
        return [
            python or sys.executable, "-m", "accelerate.commands.launch",
            *strategy.launcher_args(self),
            "--num_processes", str(self.world_size),
            "--num_machines", str(self.num_machines),
            "--machine_rank", str(machine_rank),
            "--main_process_ip", self.main_address,
            "--main_process_port", str(self.main_port or port),
            "--mixed_precision", mixed,
            "--dynamo_backend", "no",
            "-m", "ladle.train.worker", *worker_args,
        ]  # fmt: skip

    def launch_command(self, worker_args: list[str], port: int = DEFAULT_PORT) -> str:
        """The launch argv as a command a user can paste."""
        argv = self.launcher_argv(worker_args, port)
        return shlex.join(["accelerate", "launch", *argv[3:]])

    def to_markdown(self) -> str:
        rows = [
            ("strategy", self.strategy), ("device", f"{self.device} ({self.backend})"),
            ("world size", f"{self.world_size} = {self.num_machines} machine(s) x {self.processes_per_machine}"),
            ("batch", f"{self.global_batch_size} rows/step = {self.micro_batch_size} micro x "
                      f"{self.world_size} ranks x {self.gradient_accumulation} accumulation"),
            ("dtype", self.dtype),
        ]  # fmt: skip
        lines = ["# Training plan", "", "| decision | value |", "| --- | --- |"]
        lines += [f"| {k} | {v} |" for k, v in rows]
        for title, items in (("Reasons", self.reasons), ("Overrides", self.overrides), ("Warnings", self.warnings)):
            if items:
                lines += ["", f"## {title}", *[f"- {item}" for item in items]]
        if self.launcher_config:
            import json

            lines += ["", f"## {self.strategy} launcher config", "", "```json", json.dumps(self.launcher_config, indent=2), "```"]
        return "\n".join(lines) + "\n"


def check_inputs(cfg: LadleConfig) -> None:
    """The base holds a model and every data source holds a record (cheap reads only).

    Shared by the CLI (before Prefect starts) and the validate task (for deployments).

    Raises:
        LadleError: naming the field, the value and the fix.
    """
    from ladle.assets import resolve_base
    from ladle.data.prepare import check_not_empty

    resolve_base(cfg.base)
    check_not_empty(cfg.data.path)
    if cfg.data.eval_path:
        check_not_empty(cfg.data.eval_path, "data.eval_path")


def make_plan(cfg: LadleConfig, topo: Topology, config_ref: str = "CONFIG") -> Plan:
    """Decide world size, strategy, batch layout and dtype for ``cfg`` on ``topo``.

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
    strategy = choose_strategy(cfg, reasons, overrides)
    if strategy == "pipeline" and device == "cuda" and cfg.parallelism.gpus == "auto" and per_machine > cfg.parallelism.pipeline.stages:
        per_machine = world = cfg.parallelism.pipeline.stages
        reasons.append(f"{per_machine} process(es): --gpus auto adapts to one pipeline of {per_machine} stages")
    problems += strategies.get(strategy).validate(cfg, topo, world)
    replicas = 1 if strategy == "pipeline" else world  # a pipeline's ranks share one batch
    micro, accum, global_batch = choose_batch(cfg, replicas, problems, reasons)
    if strategy == "pipeline" and cfg.parallelism.pipeline.schedule == "1f1b" and accum < cfg.parallelism.pipeline.stages:
        problems.append(
            f"training.global_batch_size = {global_batch}: 1f1b needs at least one microbatch per stage "
            f"({accum} < {cfg.parallelism.pipeline.stages}). Use global_batch_size="
            f"{micro * cfg.parallelism.pipeline.stages} or more, or parallelism.pipeline.schedule=gpipe."
        )
    dtype = choose_dtype(cfg, topo, device, problems, reasons)
    problems += check_device_features(cfg, device)
    if problems:
        raise ConfigError(problems)
    plan = Plan(
        strategy=strategy,
        strategy_options=getattr(cfg.parallelism, strategies.options_section(strategy)).model_dump(),
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
        warnings.append(f"--gpus auto found no GPU: planning a CPU run of {procs} gloo process(es) (parallelism.cpu_processes)")
        reasons.append(f"{procs} process(es) per machine: CPU host, parallelism.cpu_processes={procs}")
        return "cpu", procs
    if gpus == "auto":
        reasons.append(f"{topo.gpu_count} process(es) per machine: --gpus auto uses all {topo.gpu_count} visible GPU(s)")
        return "cuda", topo.gpu_count
    if gpus > topo.gpu_count:
        fixed = shlex.join(["ladle", "run", config_ref, "--gpus", str(topo.gpu_count)])
        problems.append(
            f"parallelism.gpus = {gpus}: this host has {topo.gpu_count} visible GPU(s). "
            f"Ask for at most {topo.gpu_count}, e.g.: {fixed} (or --gpus auto)"
        )
    reasons.append(f"{gpus} process(es) per machine: --gpus {gpus} (of {topo.gpu_count} visible)")
    return "cuda", gpus


def choose_strategy(cfg, reasons, overrides) -> str:
    if cfg.parallelism.strategy != "auto":
        overrides.append(f"parallelism.strategy = {cfg.parallelism.strategy} (explicit)")
        return cfg.parallelism.strategy
    what = "LoRA adapters" if cfg.training.lora.enabled else "all weights"
    reasons.append(
        f"strategy ddp: training {what}; a full replica per rank needs no parameter gathering, so "
        "DDP's single gradient all-reduce per step is the least communication"
    )
    return "ddp"


def choose_batch(cfg, world, problems, reasons) -> tuple[int, int, int]:
    """Micro-batch, accumulation (pipeline: microbatches per step) and global batch for ``world`` data-parallel replicas."""
    micro = cfg.training.micro_batch_size
    per_step = micro * world
    wanted = cfg.training.global_batch_size or per_step
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
    if cfg.training.quantization.mode != "none" and not cfg.training.lora.enabled:
        problems.append(
            f"training.quantization.mode = {cfg.training.quantization.mode}: a 4-bit base cannot be trained "
            "directly. Set training.lora.enabled=true (QLoRA) or quantization.mode=none."
        )
    return problems
