"""Prefect block: an MLflow tracking server."""

from __future__ import annotations

from prefect.blocks.core import Block
from pydantic import Field


class MlflowServer(Block):
    """Where runs are tracked: any MLflow tracking URI (http://..., sqlite:///..., databricks)."""

    _block_type_name = "ladle mlflow server"
    tracking_uri: str = Field(description="MLflow tracking URI.")
    ui_url: str | None = Field(None, description="Base URL of the UI, for run links. null: the tracking URI.")
