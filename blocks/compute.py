"""Prefect block: where and on what a run trains (maps onto the config's ``parallelism`` and ``compute``)."""

from __future__ import annotations

from typing import Literal

from prefect.blocks.core import Block
from pydantic import Field

from ladle.config import KubernetesConfig, SlurmConfig


class ComputeTarget(Block):
    """GPUs (or CPU processes) per node, nodes, and the compute target with its options: saved once per
    cluster, named by a deployment run (`compute`), and it wins over the recipe's values."""

    _block_type_name = "ladle compute target"
    target: Literal["local", "slurm", "kubernetes"] = Field(
        "local", description="compute.target: this machine, one Slurm job, or a Kubeflow PyTorchJob."
    )
    gpus: Literal["auto"] | int = Field("auto", description="'auto' or 1..128 per node, as --gpus.")
    cpu_processes: int = Field(2, ge=1, le=64, description="Processes per node for a CPU run.")
    nodes: int = Field(1, ge=1, le=1024, description="parallelism.nodes: machines taking part.")
    slurm: SlurmConfig = Field(default_factory=SlurmConfig, description="compute.slurm (target slurm).")
    kubernetes: KubernetesConfig = Field(
        default_factory=KubernetesConfig, description="compute.kubernetes (target kubernetes)."
    )

    def overlay(self, tree: dict) -> None:
        """Write this block's settings into a config tree (``LadleConfig.model_dump()``)."""
        tree["parallelism"].update(gpus=self.gpus, cpu_processes=self.cpu_processes, nodes=self.nodes)
        tree["compute"] = {
            "target": self.target,
            "slurm": self.slurm.model_dump(),
            "kubernetes": self.kubernetes.model_dump(),
        }
