"""Prefect blocks: artifact store, MLflow server, compute target."""

from ladle.blocks.artifact_store import ArtifactStore
from ladle.blocks.compute import ComputeTarget
from ladle.blocks.mlflow_server import MlflowServer

__all__ = ["ArtifactStore", "ComputeTarget", "MlflowServer"]
