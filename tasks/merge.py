"""Prefect task: merge the LoRA adapter into a standalone model (registered later, by the promote task)."""

from __future__ import annotations

from prefect import get_run_logger, task

from ladle.assets import resolve_base
from ladle.config import LadleConfig
from ladle.lifecycle.merge import MergedModel, merge
from ladle.tasks.policy import retry_unless_user_error
from ladle.train.spec import TrainResult


@task(name="merge-lora", retries=1, retry_delay_seconds=2, retry_condition_fn=retry_unless_user_error)
def merge_task(cfg: LadleConfig, result: TrainResult, run_url: str) -> MergedModel:
    merged = merge(resolve_base(cfg.base, cfg.training.dtype), result, run_url)
    get_run_logger().info("merged model at %s (%d parameters)", merged.url, merged.parameters)
    return merged
