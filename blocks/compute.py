"""Prefect block: the compute a run asks for."""

from __future__ import annotations

from typing import Literal

from prefect.blocks.core import Block
from pydantic import Field


class ComputeTarget(Block):
    """GPUs (or CPU processes) for training; maps onto the config's ``parallelism`` section."""

    _block_type_name = "ladle compute target"
    gpus: Literal["auto"] | int = Field("auto", description="'auto' or 1..128, as --gpus.")
    cpu_processes: int = Field(2, ge=1, le=64, description="Processes for a CPU run.")
