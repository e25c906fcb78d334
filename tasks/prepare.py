"""Prefect task: prepare the dataset, cached on its content fingerprint."""

from __future__ import annotations

from datetime import timedelta

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact

from ladle import storage
from ladle.assets import resolve_base
from ladle.config import LadleConfig
from ladle.data.prepare import PreparedDataset, fingerprint, prepare
from ladle.tracking import Tracking, log_json
from ladle.tasks.policy import retry_unless_user_error


def prepare_cache_key(context, parameters) -> str:
    """Same data bytes, tokenizer, options and output store -> same prepared dataset."""
    cfg: LadleConfig = parameters["cfg"]
    return f"prepare-{fingerprint(cfg.data, resolve_base(cfg.base))}-{storage.normalise(cfg.output)}"


@task(
    name="prepare-dataset",
    cache_key_fn=prepare_cache_key,
    cache_expiration=timedelta(days=30),
    persist_result=True,
    retries=1,
    retry_delay_seconds=2,
    retry_condition_fn=retry_unless_user_error,
)
def prepare_task(cfg: LadleConfig) -> PreparedDataset:
    prepared = prepare(cfg.data, resolve_base(cfg.base), storage.normalise(cfg.output))
    report = prepared.report
    get_run_logger().info(
        "prepared %d examples into %d train / %d eval rows of %d tokens (packing efficiency %.1f%%, %d dropped)",
        report.rows_used, prepared.train_rows, prepared.eval_rows, prepared.seq_len,
        100 * report.packing_efficiency, len(report.dropped),
    )  # fmt: skip
    return prepared


def publish_report(prepared: PreparedDataset, tracking: Tracking) -> None:
    """Data report as a Prefect table artifact and an MLflow artifact (every run, cached or not)."""
    report = prepared.report.model_dump()
    table = [{"metric": k, "value": v if k != "dropped" else len(v)} for k, v in report.items()]
    create_table_artifact(key="data-report", table=table, description=f"Data report, fingerprint {prepared.fingerprint}")
    log_json(tracking, "data_report.json", report)
