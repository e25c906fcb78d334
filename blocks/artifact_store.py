"""Prefect block: where a pipeline's artifacts go (an fsspec URL plus secret credentials)."""

from __future__ import annotations

import os

from prefect.blocks.core import Block
from pydantic import Field, SecretStr


class ArtifactStore(Block):
    """An fsspec root (local folder, s3://bucket/prefix, gs://...) and the credentials to reach it.

    The credentials are exported to the environment of the run (and so of its
    training processes) under the standard AWS variable names that s3fs and
    boto read.
    """

    _block_type_name = "ladle artifact store"
    url: str = Field(description="Root URL of the artifact store, e.g. s3://my-bucket/ladle.")
    endpoint_url: str | None = Field(None, description="S3-compatible endpoint (MinIO, moto, ...). null: AWS.")
    access_key_id: SecretStr | None = Field(None, description="Access key id (null: the ambient credentials).")
    secret_access_key: SecretStr | None = Field(None, description="Secret access key.")
    region: str | None = Field(None, description="Region name.")

    def export_env(self) -> None:
        """Put the credentials into ``os.environ`` for this run and the processes it starts."""
        pairs = {
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": self.access_key_id.get_secret_value() if self.access_key_id else None,
            "AWS_SECRET_ACCESS_KEY": self.secret_access_key.get_secret_value() if self.secret_access_key else None,
            "AWS_DEFAULT_REGION": self.region,
        }
        os.environ.update({k: v for k, v in pairs.items() if v})
