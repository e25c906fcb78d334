"""Prefect task: the served model's captured traffic into this run's data (``retrain.from_traffic``)."""

from __future__ import annotations

from prefect import get_run_logger, task

from ladle.config import LadleConfig
from ladle.data.traffic import KIND_OF_OBJECTIVE, TrafficReport, curate
from ladle.tasks.policy import retry_unless_user_error

LAST_AT_TAG = "ladle.traffic.last_at"
"""On a registered version: the newest captured request or feedback it learned from (its traffic window's end)."""


def with_traffic(cfg: LadleConfig, report: TrafficReport) -> LadleConfig:
    """``cfg`` with the traffic rows as one more ``data.sources`` entry (``data.path`` becomes the first)."""
    if not report.sources:
        return cfg
    data = cfg.data.model_dump(mode="json", exclude_unset=False)
    own = data["sources"] or [{"path": data["path"]}]
    data.update(path=None, sources=[*own, *report.sources])
    return LadleConfig.model_validate({**cfg.model_dump(mode="json"), "data": data})


@task(name="curate-traffic", retries=1, retry_delay_seconds=2, retry_condition_fn=retry_unless_user_error)
def traffic_task(cfg: LadleConfig, reward_columns: list[str] | None = None) -> tuple[LadleConfig, TrafficReport]:
    """Curate the traffic (``ladle.data.traffic``) and return the config that learns from it. What is new since the
    champion's window is counted by the scheduled run's check (``count_new``), once the inputs are resolved."""
    report = curate(cfg, reward_columns=reward_columns, empty_ok=True)
    kind = KIND_OF_OBJECTIVE.get(cfg.training.objective, "")
    get_run_logger().info(
        "traffic: %d requests (%d with feedback) -> %d %s rows; dropped %s",
        report.requests,
        report.with_feedback,
        report.rows.get(kind, 0),
        kind,
        report.dropped or "none",
    )
    return with_traffic(cfg, report), report


def traffic_tags(report: TrafficReport | None) -> dict[str, str]:
    """The lineage a run and its registered version keep of the traffic it learned from."""
    if report is None:
        return {}
    tags = {
        "ladle.traffic.url": report.traffic_url,
        "ladle.traffic.first_at": report.first_at or "",
        LAST_AT_TAG: report.last_at or "",
        "ladle.traffic.requests": str(report.requests),
        "ladle.traffic.with_feedback": str(report.with_feedback),
        "ladle.traffic.rows": ",".join(f"{k}={v}" for k, v in report.rows.items()),
        "ladle.traffic.new_rows": ",".join(f"{k}={v}" for k, v in report.new_rows.items()),
        "ladle.traffic.folder": report.folder or "",
    }
    return {k: v for k, v in tags.items() if v}
