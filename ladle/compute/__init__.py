"""Compute targets: where the train stage runs the plan's launch (``compute.target``).

Each target takes the same ``TrainSpec`` and returns the same ``TrainResult``, relaying the same progress
events: ``local`` starts the plan's launch (``Plan.launcher_argv``) on this machine, ``slurm`` submits one ``sbatch`` job over
the plan's nodes and follows it, ``kubernetes`` submits a Kubeflow Trainer TrainJob (or a PyTorchJob) with kubectl and
follows it (``ladle k8s render`` prints it).
"""

from __future__ import annotations

from ladle.compute.base import ComputeTarget
from ladle.compute.kubernetes import KubernetesTarget
from ladle.compute.local import LocalTarget
from ladle.compute.slurm import SlurmTarget
from ladle.config.compute import TARGETS

for _target in (LocalTarget, SlurmTarget, KubernetesTarget):
    TARGETS.register(_target)


def get(cfg) -> ComputeTarget:
    """The target ``cfg.compute.target`` names, set up with its options."""
    return TARGETS.get(cfg.compute.target)(cfg)


__all__ = ["TARGETS", "ComputeTarget", "get"]
