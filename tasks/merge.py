"""Prefect task: merge the LoRA adapter into a standalone model (registered later, by the promote task)."""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task

from ladle.lifecycle.merge import MergedModel, merge
from ladle.tasks.policy import retry_unless_user_error
from ladle.train.spec import TrainResult


@task(name="merge-lora", retries=1, retry_delay_seconds=2, retry_condition_fn=retry_unless_user_error)
def merge_task(base_dir: str, result: TrainResult, run_url: str) -> MergedModel:
    merged = merge(Path(base_dir), result, run_url)
    get_run_logger().info("merged model at %s (%d parameters)", merged.url, merged.parameters)
    return merged
