"""The fine-tune pipeline: probe -> plan -> prepare -> train -> merge -> evaluate -> deploy."""

from __future__ import annotations

import json
import logging
import re
import time
import uuid

from prefect import flow, get_run_logger, runtime
from prefect.artifacts import create_link_artifact
from prefect.states import Completed

from ladle.config import LadleConfig
from ladle.errors import LadleError, find_ladle_error
from ladle.lifecycle import lineage, promote, retraining, tracking
from ladle.plan.inputs import RunInputs
from ladle.platform import storage
from ladle.platform.secrets import install_log_redaction, redact_url
from ladle.rewards import RewardSet
from ladle.tasks.deploy import deploy_task, shadow_plan
from ladle.tasks.evaluate import evaluate_task
from ladle.tasks.inputs import inputs_task
from ladle.tasks.merge import merge_task
from ladle.tasks.plan import plan_task
from ladle.tasks.prepare import prepare_cached, publish_report
from ladle.tasks.probe import probe_task
from ladle.tasks.promote import promote_task
from ladle.tasks.traffic import traffic_tags, traffic_task
from ladle.tasks.train import train_task


class Stopwatch:
    """Wall time per stage, reported in the run summary (and read by bench/)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, stage: str) -> None:
        now = time.perf_counter()
        self.seconds[stage] = round(now - self._last, 3)
        self._last = now


RUN_ID = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$"


def data_unchanged(inputs: RunInputs) -> tuple[promote.Version | None, str]:
    """``(the champion when it was trained from exactly these inputs, why: what is unchanged or what changed
    since the champion)``.

    The run's fingerprint (``ladle.lifecycle.lineage``) covers the data files' contents (ETags on object stores),
    the tokenizer and every data option, the base's weights and the training settings that decide what is
    learned; it is computed without preparing anything. A champion registered without one is never "the same".
    """
    fp = inputs.fingerprint
    current = promote.champion(inputs.tracking_uri, inputs.registered_model)
    if current is None:
        return None, "no champion yet"
    if current.tags.get(lineage.TAG) == fp:
        return current, f"data, base and training unchanged since version {current.version}"
    recorded = current.tags.get(lineage.PARTS_TAG)
    changed = lineage.what_changed(json.loads(recorded) if recorded else None, inputs.lineage)
    return None, f"changed since champion v{current.version}: " + "; ".join(changed)


def record_check(inputs: RunInputs, flow_run_id: str, decision: str, reason: str) -> None:
    """The scheduled run's decision on the registered model (``ladle model list`` shows it)."""
    entry = {"decision": decision, "reason": reason, "fingerprint": inputs.fingerprint, "flow_run_id": flow_run_id}
    retraining.record_retraining_check(inputs.tracking_uri, inputs.registered_model, entry)


def probe_lines(config, scores, result) -> dict:
    """The probe's part of the summary: before and after (the gate's), and during training where GRPO asked it (its
    ``[step, score]`` checks and what its guard did)."""
    if not config.eval.probe:
        return {}
    during = {k: v for k, v in (result.rl or {}).items() if k in ("probe_trend", "probe_guard")}
    return {"probe_before": scores.base.get("probe"), "probe_after": scores.model.get("probe"), **during}


@flow(name="finetune", description="Fine-tune a base model on a dataset, gate it, and serve it.")
def finetune(
    config: LadleConfig, config_ref: str = "CONFIG", run_id: str | None = None, skip_if_data_unchanged: bool = False
):
    """Run the whole pipeline for ``config``; returns the run summary (in a Completed state with a message).

    Args:
        config: the validated config (``--gpus`` and ``--set`` already applied).
        config_ref: how the user named the config, for printed commands.
        run_id: a stable name for the run's folder. A run given the run_id of one that crashed or was
            cancelled resumes from its last complete checkpoint. None: a new folder per flow run.
        skip_if_data_unchanged: end early, Completed and "skipped", when the registered model's champion
            was trained from the same data, base weights and training settings (``ladle.lifecycle.lineage``; scheduled
            retraining).
    """
    install_log_redaction()
    tracking.apply_deadlines(config)  # MLflow's and the artifact store's, before anything reaches either
    if run_id is not None and not re.fullmatch(RUN_ID, run_id):
        raise LadleError(
            f"run_id = {run_id!r}: use 1-100 letters, digits, '.', '_' or '-', starting with one of the first two."
        )
    flow_run_id = str(runtime.flow_run.id or uuid.uuid4())
    traffic = None
    if config.retrain.from_traffic:  # the served model's traffic as one more source, before anything is resolved
        config, traffic = traffic_task(config, reward_columns(config))
    inputs = inputs_task(config)  # resolved once: every stage below takes what it needs from here
    if traffic is not None:
        inputs = inputs.model_copy(update={"traffic": traffic.model_dump()})
    if skip_if_data_unchanged:
        skipped = skip_check(inputs, flow_run_id, config)
        if skipped is not None:
            return skipped
    shadow = shadow_plan(config, inputs)  # its refusals before anything trains; replayed at the deploy stage
    run_name = run_id or f"{config.name}-{flow_run_id[:8]}"
    run_url = storage.join(inputs.output, "runs", run_name)
    parent = runtime.flow_run.parent_flow_run_id
    track = tracking.start_run(
        config,
        flow_run_id,
        run_name,
        parent_flow_run_id=str(parent) if parent else None,
        where=(inputs.tracking_uri, inputs.artifact_location),
    )
    create_link_artifact(key="mlflow-run", link=track.ui_link, description=f"MLflow run {track.run_id} ({track.uri})")
    if traffic is not None:  # lineage: traffic -> rows -> this run (-> the version promote registers)
        tracking.set_tags(track, traffic_tags(traffic))
        tracking.log_json(track, "traffic/report.json", traffic.model_dump())
    clock = Stopwatch()
    ok = False
    try:
        topo = probe_task(config)
        clock.lap("probe")
        plan = plan_task(config, topo, inputs.base_config, track, config_ref)
        clock.lap("plan")
        prepared = prepare_cached(config.data, inputs)
        publish_report(prepared, track)
        clock.lap("prepare")
        result = train_task(config, plan, prepared, inputs.base_dir, run_url, track, inputs.reward_files)
        clock.lap("train")
        merged = merge_task(inputs.base_dir, result, run_url)
        clock.lap("merge")
        scores = evaluate_task(
            config.eval,
            inputs.base_dir,
            merged,
            prepared,
            track,
            RewardSet.of_run(config.training, inputs.reward_files),
        )
        clock.lap("evaluate")
        endpoint = deploy_task(
            config.serving(), config.name, merged, prepared, result, config.promote, inputs.base_dir, shadow
        )
        if endpoint.shadow is not None:  # both answers of every replayed request, for a person to read
            tracking.log_json(track, "shadow/report.json", endpoint.shadow)
        clock.lap("deploy")
        decision = (
            promote_task(config, inputs, merged, prepared, scores, endpoint, result, plan, track, flow_run_id)
            if config.promote.enabled
            else None
        )
        clock.lap("promote")
        ok = True
    finally:
        tracking.end_run(track, ok)
    summary = run_summary(config, inputs, run_name, run_url, flow_run_id, track, result, merged, scores, endpoint)
    summary.update(
        promoted=decision.promoted if decision else None,
        canary=decision.canary if decision else None,
        promotion=decision.reason if decision else "promotion off (promote.enabled=false): nothing registered",
        dataset_fingerprint=prepared.fingerprint,
        stage_seconds=clock.seconds,
    )
    storage.write_json(storage.join(run_url, "summary.json"), summary)
    return Completed(message=summary["promotion"], data=summary)


def reward_columns(config: LadleConfig) -> list[str] | None:
    if config.training.objective != "grpo":
        return None
    from ladle import rewards

    return rewards.columns_needed(config.training.rl.rewards, rewards.bundle(config.training.rl.rewards))


def too_little_traffic(inputs, config: LadleConfig) -> tuple[promote.Version, str] | None:
    """``retrain.min_new_feedback``: (the champion, why) when the traffic brought fewer new rows of the objective's
    kind than asked since the champion's window; None when there are enough, no champion, or no such rule."""
    need = config.retrain.min_new_feedback
    if not (config.retrain.from_traffic and need and inputs.traffic is not None):
        return None
    current = promote.champion(inputs.tracking_uri, inputs.registered_model)
    if current is None:
        return None
    from ladle.data.traffic import KIND_OF_OBJECTIVE, count_new
    from ladle.tasks.traffic import LAST_AT_TAG

    kind = KIND_OF_OBJECTIVE.get(config.training.objective, "")
    after = current.tags.get(LAST_AT_TAG)
    new = count_new(inputs.traffic.get("folder"), kind, after)
    if new >= need:
        return None
    since = after or "the start of the traffic"
    return current, (
        f"{new} new {kind} rows from traffic since champion v{current.version}'s window ({since}); "
        f"retrain.min_new_feedback = {need}"
    )


def skip_check(inputs, flow_run_id: str, config: LadleConfig | None = None) -> Completed | None:
    """Scheduled retraining's first question: a Completed "skipped" state when the champion was trained from the
    same data, base and settings (``ladle.lifecycle.lineage``), or when the traffic brought too few new rows to
    learn from (``retrain.min_new_feedback``), else None (and the reason to train is logged); either way the
    decision is recorded on the registered model."""
    fp = inputs.fingerprint
    same, why = data_unchanged(inputs)
    little = too_little_traffic(inputs, config) if config is not None and same is None else None
    if little is not None:
        same, why = little
    if same is None:
        get_run_logger().info("retraining: %s (fingerprint %s)", why, fp)
        record_check(inputs, flow_run_id, "trained", why)
        return None
    reason = f"skipped: {why} (fingerprint {fp})"
    get_run_logger().info(reason)
    record_check(inputs, flow_run_id, "skipped", why)
    summary = {"status": "skipped", "reason": reason, "champion_version": same.version}
    return Completed(message=reason, data={**summary, "dataset_fingerprint": fp, "flow_run_id": flow_run_id})


def run_summary(config, inputs, run_name, run_url, flow_run_id, track, result, merged, scores, endpoint) -> dict:
    """What a finished run reports (``summary.json``, the flow's result): its outcome at each stage."""
    return {
        "status": "ok",
        "run_id": run_name,
        "registered_model": inputs.registered_model,
        "endpoint": endpoint.url,
        "endpoint_running": endpoint.running,
        "server_pid": endpoint.pid,
        "prompt": endpoint.prompt,
        "answer": endpoint.answer,
        "expected": endpoint.expected,
        "answer_correct": endpoint.answer_correct,
        "parity": endpoint.parity.model_dump() if endpoint.parity else None,
        "served_unmerged": endpoint.unmerged,
        "shadow": {k: v for k, v in endpoint.shadow.items() if k != "worst"} if endpoint.shadow else None,
        "mlflow_run_id": track.run_id,
        "mlflow_tracking_uri": redact_url(track.uri),
        "flow_run_id": flow_run_id,
        "strategy": result.strategy,
        "world_size": result.world_size,
        "backend": result.backend,
        "train_loss_first": result.train_loss_first,
        "train_loss_last": result.train_loss_last,
        "eval_loss_before": result.eval_loss_before,
        "eval_loss_after": result.eval_loss_after,
        "eval_accuracy_before": scores.accuracy_before,
        "eval_accuracy_after": scores.accuracy_after,
        "eval_examples": scores.examples,
        "eval_metric": scores.metric,
        **probe_lines(config, scores, result),
        "eval_before": scores.base,
        "eval_after": scores.model,
        "resumed_from_step": result.resumed_from_step,
        "tokens_per_s": result.tokens_per_s,
        "steps": result.steps,
        "output_url": run_url,
        "merged_model_url": merged.url,
    }


class HideUserErrorTracebacks(logging.Filter):
    """Show expected input errors (LadleError) as one line in Prefect's console log.

    Prefect logs every task and flow failure with its traceback. For a
    ``LadleError`` the message already names the field and the fix, so the
    traceback is noise; any other exception keeps it.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and find_ladle_error(record.exc_info[1]) is not None:
            err = find_ladle_error(record.exc_info[1])
            record.msg, record.args, record.exc_info, record.exc_text = (
                f"{err.__class__.__name__}: {err}",
                (),
                None,
                None,
            )
        return True


def install_log_filter() -> None:
    """Attach the filter to every handler of Prefect's loggers."""
    from prefect.logging.configuration import setup_logging

    setup_logging()
    for name in ("prefect", "prefect.flow_runs", "prefect.task_runs", ""):
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, HideUserErrorTracebacks) for f in handler.filters):
                handler.addFilter(HideUserErrorTracebacks())
