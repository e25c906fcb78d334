"""The training plan: what the planner decided (``ladle.plan.planner`` decides it, step by step, each step a
``Decision``), how it launches and how it reads.

``Plan`` is what travels: into the train spec, the MLflow run, the Prefect artifact and ``ladle plan --json``.
``launcher_argv`` renders the ``accelerate launch`` command that starts a machine's training processes;
``to_markdown`` renders the plan for people.
"""

from __future__ import annotations

import json
import shlex
import sys
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel, Field

from ladle import strategies
from ladle.strategies.mesh import Dims

DEFAULT_PORT = 29500


T = TypeVar("T")


@dataclass(frozen=True)
class Decision(Generic[T]):
    """One planning step's result: its value, why, and what it warns about, refuses or lets win."""

    value: T
    reasons: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    problems: tuple[str, ...] = ()
    overrides: tuple[str, ...] = ()


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
    eval_micro_batch_size: int = Field(0, description="Rows per rank per eval forward (0: micro_batch_size).")
    gradient_checkpointing: bool = Field(
        False, description="Activations recomputed in backward (training.gradient_checkpointing, auto resolved)."
    )
    gradient_accumulation: int
    global_batch_size: int = Field(description="Packed rows per optimizer step across all ranks.")
    dtype: Literal["float32", "bfloat16", "float16"]
    kernels: dict[str, Any] = Field(
        default_factory=dict,
        description="The step's fast paths (training.kernels resolved for this strategy and device): compile, "
        "fused_loss, loss_chunk_mib, liger, lora_compute, padding_free, packed_attention. 'auto' entries are settled on the training host.",
    )
    merged_rollouts: bool = Field(
        False,
        description="grpo with LoRA: the engine samples with the adapters merged into a copy of the adapted "
        "weights (training.rl.merge_for_rollouts, null resolved by memory).",
    )
    reference: Literal["precomputed", "adapters_off", "none"] | None = Field(
        None,
        description="Preference tuning: where the reference log-probabilities come from (none: a reference-free "
        "loss); null for supervised fine-tuning.",
    )
    reasons: list[str] = Field(default_factory=list, description="Why each decision was made.")
    overrides: list[str] = Field(default_factory=list, description="Explicit settings that won.")
    warnings: list[str] = Field(default_factory=list)
    candidates: list[dict[str, Any]] = Field(
        default_factory=list,
        description="Every strategy the sizing considered, fastest first: per-rank memory, whether it fits, why.",
    )
    memory: dict[str, int] = Field(
        default_factory=dict,
        description="Bytes the chosen layout needs: per rank while loading (`load`) and per training step "
        "(`train`); host RAM for the LoRA merge (`merge`); per serving device (`serve`). Empty: model size unknown.",
    )
    mesh: dict[str, int] = Field(
        default_factory=dict,
        description="Parallelism degrees on the device mesh (pp, dp_replicate, dp_shard, cp, sp, tp): their product is "
        "the world size. Named strategies are presets (ddp: dp_replicate = world; fsdp2: dp_shard = world; ...).",
    )
    model_shape: dict[str, int] | None = Field(
        None, description="The base's sizes that launcher configs are sized from (None: no config.json at hand)."
    )

    def launcher_argv(
        self,
        worker_args: list[str],
        port: int = DEFAULT_PORT,
        python: str | None = None,
        machine_rank: int = 0,
        main_address: str | None = None,
        main_port: int | None = None,
    ) -> list[str]:
        """The argv that starts this machine's training processes (a list, never a shell string): ``accelerate
        launch`` on GPUs and across machines; on one CPU machine ladle's launcher (``ladle.train.launch``), which
        takes the same arguments and forks the ranks from one process that imported their libraries once.

        Across machines, torchrun's static rendezvous meets at ``main_address:main_port`` (a c10d TCP
        store on node 0) and ``machine_rank`` fixes each node's ranks, so global rank 0, which logs
        and writes, is always on node 0 where the pipeline relays its progress. ``main_address`` and
        ``main_port`` replace the plan's when a scheduler placed the nodes.
        """
        strategy = strategies.get(self.strategy)
        mixed = {"float32": "no", "bfloat16": "bf16", "float16": "fp16"}[self.dtype]
        return [
            python or sys.executable,
            "-m",
            self.launcher_module,
            *strategy.launcher_args(self),
            "--num_processes",
            str(self.world_size),
            "--num_machines",
            str(self.num_machines),
            "--machine_rank",
            str(machine_rank),
            "--main_process_ip",
            main_address or self.main_address,
            "--main_process_port",
            str(main_port or self.main_port or port),
            "--mixed_precision",
            mixed,
            "--dynamo_backend",
            "no",
            "-m",
            "ladle.train.worker",
            *worker_args,
        ]

    @property
    def launcher_module(self) -> str:
        """``ladle.train.launch`` for one CPU machine (same arguments, ranks forked from one process that imported
        their libraries once: ~4 s of CPU less per rank); ``accelerate.commands.launch`` on GPUs and across
        machines (torchrun's agents meet every node before a rank starts, under a join deadline)."""
        return "ladle.train.launch" if self.device == "cpu" and self.num_machines == 1 else "accelerate.commands.launch"

    def launch_command(self, worker_args: list[str], port: int = DEFAULT_PORT) -> str:
        """The launch argv as a command a user can paste."""
        argv = self.launcher_argv(worker_args, port)
        forked = self.launcher_module == "ladle.train.launch"
        head = ["python", "-m", self.launcher_module] if forked else ["accelerate", "launch"]
        return shlex.join([*head, *argv[3:]])

    @property
    def replicas(self) -> int:
        """Data-parallel replicas (ranks reading different rows): the mesh's dp_replicate x dp_shard."""
        return Dims.of(self.mesh).dp if self.mesh else self.world_size

    def to_markdown(self) -> str:
        rows = [
            ("strategy", self.strategy),
            ("mesh", Dims.of(self.mesh).describe() if self.mesh else "-"),
            ("device", f"{self.device} ({self.backend})"),
            ("world size", f"{self.world_size} = {self.num_machines} machine(s) x {self.processes_per_machine}"),
            (
                "batch",
                f"{self.global_batch_size} rows/step = {self.micro_batch_size} micro x "
                f"{self.replicas} replica(s) x {self.gradient_accumulation} accumulation",
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
            lines += [
                "",
                f"## {self.strategy} launcher config",
                "",
                "```json",
                json.dumps(self.launcher_config, indent=2),
                "```",
            ]
        return "\n".join(lines) + "\n"
