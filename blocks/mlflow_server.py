"""Prefect block: an MLflow tracking server."""

from __future__ import annotations

from prefect.blocks.core import Block
from pydantic import Field, SecretStr


class MlflowServer(Block):
    """Where runs are tracked: any MLflow tracking URI (http://..., sqlite:///..., databricks).

    The URI is a secret field: one may carry a password (``https://user:password@...``), which Prefect then keeps
    masked in its UI and API, and ladle moves to MLflow's environment instead of the config."""

    _block_type_name = "ladle mlflow server"
    tracking_uri: SecretStr = Field(description="MLflow tracking URI (its password, if any, is kept secret).")
    ui_url: str | None = Field(None, description="Base URL of the UI, for run links. null: the tracking URI.")
