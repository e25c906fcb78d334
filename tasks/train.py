"""Prefect task: distributed training, with progress relayed to the run log."""

from __future__ import annotations

import time

from prefect import get_run_logger, task
from prefect.artifacts import create_progress_artifact, update_progress_artifact

from ladle import compute
from ladle.config import LadleConfig
from ladle.data.prepare import PreparedDataset
from ladle.lifecycle.tracking import Tracking, log_loss_curve
from ladle.plan.planner import Plan
from ladle.tasks.policy import retry_unless_user_error
from ladle.train.spec import TrainResult, TrainSpec


def progress_relay(logger, min_interval_s: float = 2.0):
    """A callback that logs worker progress and advances a progress artifact.

    Every step is in MLflow already; the Prefect log and artifact get a line at
    most every ``min_interval_s`` (and the first and last step), because each
    one is an API call that competes with the training processes for the cores.
    """
    artifact_id = create_progress_artifact(progress=0.0, key="train-progress", description="Training progress")
    last = {"time": float("-inf")}

    def relay(event: dict) -> None:
        if event["event"] == "step":
            now = time.monotonic()
            if now - last["time"] < min_interval_s and event["step"] not in (1, event["steps"]):
                return
            last["time"] = now
            logger.info(
                "step %d/%d loss %.4f lr %.2e %.0f tok/s elapsed %.1fs",
                event["step"],
                event["steps"],
                event["loss"],
                event["lr"],
                event["tokens_per_s"],
                event["elapsed_s"],
            )
            update_progress_artifact(artifact_id, progress=100.0 * event["step"] / event["steps"])
        elif event["event"] == "probe":
            logger.info("probe at step %d: %.2f (started at %.2f)", event["step"], event["score"], event["start"])
        elif event["event"] == "probe_guard":
            logger.warning("probe guard: %s", event["why"])
        elif event["event"] == "start":
            logger.info("training started: %s", {k: v for k, v in event.items() if k != "event"})
        elif event["event"] == "done":
            update_progress_artifact(artifact_id, progress=100.0)

    return relay


def parity_probe(cfg: LadleConfig, prepared: PreparedDataset, base_dir: str):
    """The held-out conversations the served model is compared on (``ladle.lifecycle.parity``), as training
    tokenizes them; for grpo, its held-out chat prompts (their ids are training's)."""
    from pathlib import Path

    from ladle.data.prepare import load_tokenizer
    from ladle.lifecycle import parity
    from ladle.lifecycle.evaluate import load_prompt_rows, load_samples

    if cfg.training.objective == "grpo":
        return parity.prompt_probe(load_prompt_rows(prepared, 4 * parity.PROBE_ROWS))
    conversations = load_samples(prepared, 4 * parity.PROBE_ROWS)
    return parity.probe(load_tokenizer(Path(base_dir)), conversations, cfg.data) if conversations else []


# A retry resumes from the last complete checkpoint of the same run folder.
@task(name="train", retries=1, retry_delay_seconds=5, retry_condition_fn=retry_unless_user_error)
def train_task(
    cfg: LadleConfig,
    plan: Plan,
    prepared: PreparedDataset,
    base_dir: str,
    run_url: str,
    tracking: Tracking,
    reward_files: dict[str, str] | None = None,
) -> TrainResult:
    logger = get_run_logger()
    spec = TrainSpec(
        config=cfg,
        plan=plan,
        dataset=prepared,
        base_dir=base_dir,
        run_url=run_url,
        tracking_uri=tracking.uri,
        mlflow_run_id=tracking.run_id,
        reward_files=reward_files or {},
        parity_probe=[row.model_dump() for row in parity_probe(cfg, prepared, base_dir)],
    )
    result = compute.get(cfg).run(
        spec,
        on_progress=progress_relay(logger),
        on_line=logger.debug,
        on_command=lambda command: logger.info("launch: %s", command),
    )
    log_loss_curve(tracking, result.train_losses, result.eval_loss_before, result.eval_loss_after)
    return result.model_copy(update={"parity_probe": spec.parity_probe})
