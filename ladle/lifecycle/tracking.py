"""MLflow tracking: one run per pipeline run, on SQLite by default.

Default store: ``sqlite:///<output>/mlflow.db`` with artifacts beside it when
the output is a local folder; ``$LADLE_HOME/mlflow`` when the output is remote
(SQLite cannot live in an object store).
"""

from __future__ import annotations

import io
import json
import os
import tempfile
import time
from pathlib import Path

import yaml
from pydantic import BaseModel

from ladle.assets import ladle_home
from ladle.config import LadleConfig, flatten
from ladle.lifecycle import mlflow_client as mlflow_registry
from ladle.platform import secrets, storage
from ladle.platform.secrets import redact, redact_url

PARAM_MAX = 6000


class Tracking(BaseModel):
    uri: str
    run_id: str
    experiment_id: str
    ui_link: str


def default_location(cfg: LadleConfig) -> Path:
    if storage.is_local(cfg.output):
        return storage.local_path(storage.normalise(cfg.output))
    return ladle_home() / "mlflow"


def tracking_uri(cfg: LadleConfig) -> tuple[str, str | None]:
    """``(tracking URI, artifact location for a new experiment or None)``.

    ``tracking.uri``, else ``$MLFLOW_TRACKING_URI``, else SQLite beside the outputs. Credentials in an
    http(s) URI are kept by this process for that server alone (``ladle.platform.secrets``: MLflow's client
    here, the training processes' ``MLFLOW_TRACKING_USERNAME``/``PASSWORD``), so the URI ladle passes around,
    logs and writes into specs carries none.
    """
    apply_deadlines(cfg)
    uri = cfg.tracking.uri or os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return strip_credentials(uri), None
    folder = default_location(cfg)
    folder.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{folder / 'mlflow.db'}", (folder / "mlartifacts").as_uri()


DEADLINE_ENV = {
    "request_timeout_s": "MLFLOW_HTTP_REQUEST_TIMEOUT",
    "request_retries": "MLFLOW_HTTP_REQUEST_MAX_RETRIES",
}


def apply_deadlines(cfg: LadleConfig) -> None:
    """``tracking.request_timeout_s`` and ``request_retries`` as MLflow's environment (read per request, and
    inherited by the training processes): a value set in the config wins, then the environment's, then
    ladle's defaults (MLflow's own let a dead server hold a stage for minutes). The artifact store's
    ``storage.*`` deadlines too (``storage.apply_deadlines``)."""
    storage.apply_deadlines(cfg)
    for field, var in DEADLINE_ENV.items():
        value = getattr(cfg.tracking, field)
        if field in cfg.tracking.model_fields_set or var not in os.environ:
            os.environ[var] = str(int(value) if float(value).is_integer() else value)


strip_credentials = secrets.strip_credentials
client = mlflow_registry.client  # one MLflow client, with request deadlines, for runs and the registry alike


def start_run(
    cfg: LadleConfig,
    flow_run_id: str | None,
    run_name: str,
    parent_flow_run_id: str | None = None,
    where: tuple[str, str | None] | None = None,
) -> Tracking:
    """Create the MLflow run, tagged with the Prefect flow-run id(s), with the config as params.

    Args:
        where: ``(tracking URI, artifact location)`` when the caller resolved them (a run's ``RunInputs``);
            else ``tracking_uri(cfg)``.
    """
    uri, artifacts = where or tracking_uri(cfg)
    mlflow = client(uri)
    experiment = mlflow.get_experiment_by_name(cfg.tracking.experiment)
    exp_id = (
        experiment.experiment_id
        if experiment
        else mlflow.create_experiment(cfg.tracking.experiment, artifact_location=artifacts)
    )
    tags = {"ladle.config_name": cfg.name, "mlflow.runName": run_name}
    if flow_run_id:
        tags["prefect.flow_run_id"] = flow_run_id
    if parent_flow_run_id:  # a deployment's flow run that started this pipeline as a subflow
        tags["prefect.parent_flow_run_id"] = parent_flow_run_id
    run = mlflow.create_run(exp_id, tags=tags, run_name=run_name)
    link = f"{cfg.tracking.ui_url.rstrip('/')}/#/experiments/{exp_id}/runs/{run.info.run_id}"
    tracking = Tracking(uri=uri, run_id=run.info.run_id, experiment_id=exp_id, ui_link=redact_url(link))
    log_params(tracking, flatten(cfg.model_dump(mode="json")), prefix="config.")
    log_text(tracking, "config.yaml", yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    return tracking


def log_params(tracking: Tracking, params: dict[str, str], prefix: str = "") -> None:
    from mlflow.entities import Param

    items = [Param(f"{prefix}{k}"[:250], redact(str(v))[:PARAM_MAX]) for k, v in params.items()]
    mlflow = client(tracking.uri)
    for start in range(0, len(items), 100):
        mlflow.log_batch(tracking.run_id, params=items[start : start + 100])


def log_text(tracking: Tracking, name: str, text: str) -> None:
    client(tracking.uri).log_text(tracking.run_id, redact(text), name)


def log_json(tracking: Tracking, name: str, obj) -> None:
    log_text(tracking, name, json.dumps(obj, indent=2, default=str))


def log_bytes(tracking: Tracking, name: str, data: bytes) -> None:
    """Log a file's bytes as a run artifact called ``name``."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / name
        path.write_bytes(data)
        client(tracking.uri).log_artifact(tracking.run_id, str(path))


def log_loss_curve(tracking: Tracking, losses: list[float], eval_before: float, eval_after: float) -> None:
    """Plot per-step train loss with the eval loss before and after, as ``loss_curve.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot(range(1, len(losses) + 1), losses, label="train loss")
    ax.scatter([0, len(losses)], [eval_before, eval_after], color="tab:red", zorder=3, label="eval loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats/token)")
    ax.legend()
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png")
    plt.close(fig)
    log_bytes(tracking, "loss_curve.png", png.getvalue())


def end_run(tracking: Tracking, ok: bool) -> None:
    client(tracking.uri).set_terminated(tracking.run_id, status="FINISHED" if ok else "FAILED")


def log_evaluation(tracking: Tracking, result, data_fingerprint: str) -> None:
    """Every score of the base (``*_before``) and the new model (``*_after``) as metrics, plus the examples,
    tagged with the fingerprint of the data they were measured on."""
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    metrics = [Metric(f"eval_{metric_key(name)}_before", value, now, 0) for name, value in result.base.items()]
    metrics += [Metric(f"eval_{metric_key(name)}_after", value, now, 0) for name, value in result.model.items()]
    if result.accuracy_before is not None:  # exact match is also reported under its historical name
        metrics += [
            Metric("eval_accuracy_before", result.accuracy_before, now, 0),
            Metric("eval_accuracy_after", result.accuracy_after, now, 0),
        ]
    metrics.append(Metric("eval_examples", result.examples, now, 0))
    mlflow = client(tracking.uri)
    mlflow.log_batch(tracking.run_id, metrics=metrics)
    mlflow.set_tag(tracking.run_id, "ladle.data_fingerprint", data_fingerprint)
    log_json(tracking, "evaluation.json", {**result.model_dump(), "data_fingerprint": data_fingerprint})


def metric_key(name: str) -> str:
    """A metric's name as MLflow accepts it: a user metric's ``module:function`` becomes ``module.function``."""
    return "".join(c if c.isalnum() or c in "_-./ " else "." for c in name)


def set_tags(tracking: Tracking, tags: dict[str, str]) -> None:
    """Tags on the run (its lineage: what it learned from)."""
    from mlflow.entities import RunTag

    items = [RunTag(k[:250], redact(str(v))[:5000]) for k, v in tags.items()]
    if items:
        client(tracking.uri).log_batch(tracking.run_id, tags=items)
