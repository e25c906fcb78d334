"""Prefect task: the merged model's (and the cached base's) scores on the held-out split."""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact

from ladle.config import EvalConfig
from ladle.data.prepare import PreparedDataset
from ladle.fleet.deploy import local_model_dir
from ladle.lifecycle.evaluate import Evaluation, evaluate
from ladle.lifecycle.merge import MergedModel
from ladle.lifecycle.tracking import Tracking, log_evaluation
from ladle.rewards import RewardSet
from ladle.tasks.policy import retry_unless_user_error


@task(name="evaluate", retries=1, retry_delay_seconds=2, retry_condition_fn=retry_unless_user_error)
def evaluate_task(
    eval_cfg: EvalConfig,
    base_dir: str,
    merged: MergedModel,
    prepared: PreparedDataset,
    tracking: Tracking,
    rewards: RewardSet | None = None,
) -> Evaluation:
    result = evaluate(Path(base_dir), local_model_dir(merged), prepared, eval_cfg, rewards)
    logger = get_run_logger()
    if result.note:
        logger.info(result.note)
    for name in result.model:
        logger.info(
            "%s on %s: %.4g before (base%s) -> %.4g after",
            name,
            f"the probe ({eval_cfg.probe}, {result.probe_questions} questions)"
            if name == "probe"
            else f"the held-out split ({result.examples} conversations, {result.eval_rows} eval rows)",
            result.base.get(name, float("nan")),
            ", cached" if result.base_cached else "",
            result.model[name],
        )
    log_evaluation(tracking, result, prepared.fingerprint)
    if result.probe_shown:
        create_table_artifact(
            key="probe-answers",
            table=result.probe_shown,
            description="eval.probe: questions, greedy answers before and after",
        )
    if result.examples_shown:
        create_table_artifact(
            key="eval-examples",
            table=result.examples_shown,
            description="Held-out prompts, expected and greedy answers",
        )
    return result
