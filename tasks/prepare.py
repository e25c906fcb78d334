"""Prefect task: prepare the dataset, cached on its content fingerprint."""

from __future__ import annotations

from datetime import timedelta

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact

from ladle.config import DataConfig
from ladle.data.prepare import PreparedDataset, prepare
from ladle.lifecycle.tracking import Tracking, log_bytes, log_json, log_params
from ladle.plan.inputs import RunInputs
from ladle.platform import storage
from ladle.tasks.policy import retry_unless_user_error


def prepare_cache_key(context, parameters) -> str:
    """Same data bytes, tokenizer, options and output store -> same prepared dataset."""
    inputs: RunInputs = parameters["inputs"]
    return f"prepare-{inputs.data_fingerprint}-{inputs.output}"


def prepare_cached(data: DataConfig, inputs: RunInputs, **call):
    """``prepare_task``, refreshing its cache record when the dataset it would point at is gone.

    A dataset deleted since it was cached (``make clean``, a wiped bucket) is prepared again and the record
    rewritten, instead of the cache handing back a folder that no longer exists.
    """
    fresh = storage.is_complete(inputs.dataset_url)
    task_ = prepare_task if fresh else prepare_task.with_options(refresh_cache=True)
    return task_(data, inputs, **call)


@task(
    name="prepare-dataset",
    cache_key_fn=prepare_cache_key,
    cache_expiration=timedelta(days=30),
    persist_result=True,
    retries=1,
    retry_delay_seconds=2,
    retry_condition_fn=retry_unless_user_error,
)
def prepare_task(data: DataConfig, inputs: RunInputs) -> PreparedDataset:
    prepared = prepare(
        data,
        inputs.base,
        inputs.output,
        data_fingerprint=inputs.data_fingerprint,
        objective=inputs.objective,
        reward_columns=inputs.reward_columns,
    )
    report = prepared.report
    get_run_logger().info(
        "prepared %d examples into %d train / %d eval rows of %d tokens (packing efficiency %.1f%%, %d dropped)",
        report.rows_used,
        prepared.train_rows,
        prepared.eval_rows,
        prepared.seq_len,
        100 * report.packing_efficiency,
        len(report.dropped),
    )
    return prepared


def publish_report(prepared: PreparedDataset, tracking: Tracking) -> None:
    """Data report as Prefect table artifacts and MLflow artifacts (every run, cached or not)."""
    report = prepared.report.model_dump()
    skip = ("dropped", "length_histogram", "sources", "mix")
    table = [{"metric": k, "value": v} for k, v in report.items() if k not in skip]
    table.append({"metric": "dropped", "value": len(report["dropped"])})
    create_table_artifact(
        key="data-report", table=table, description=f"Data report, fingerprint {prepared.fingerprint}"
    )
    if report.get("mix"):  # data.sources: each source's ask and share, asked against achieved
        create_table_artifact(key="data-mix", table=report["mix"], description="The mix of data.sources, per source")
        shares = {m["name"]: f"asked {m['asked_share']:.2%}, achieved {m['achieved_share']:.2%}" for m in report["mix"]}
        log_params(tracking, shares, prefix="data.mix.")
    if report["dropped"]:
        create_table_artifact(
            key="data-dropped-rows", table=report["dropped"][:1000], description="Rows not used, by line"
        )
    log_json(tracking, "data_report.json", report)
    log_bytes(tracking, "length_histogram.png", storage.read_bytes(storage.join(prepared.url, "length_histogram.png")))
