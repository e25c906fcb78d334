"""Prefect task: register the evaluated, smoke-tested model as ``challenger`` and gate it to ``champion``."""

from __future__ import annotations

import json
from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact

from ladle.config import LadleConfig
from ladle.data.prepare import PreparedDataset
from ladle.fleet.deploy import Endpoint
from ladle.lifecycle import gate, lineage, promote
from ladle.lifecycle.copies import full_model_dir_of
from ladle.lifecycle.evaluate import Evaluation, score
from ladle.lifecycle.events import CANARY, emit_canary, emit_promoted
from ladle.lifecycle.merge import MergedModel
from ladle.lifecycle.tracking import Tracking, client, metric_key
from ladle.plan.inputs import RunInputs
from ladle.plan.planner import Plan
from ladle.rewards import RewardSet
from ladle.tasks.policy import retry_unless_user_error
from ladle.train.spec import TrainResult


def reference_scores(
    cfg: LadleConfig,
    prepared: PreparedDataset,
    evaluation: Evaluation,
    current: promote.Version | None,
    base_dir: str | None = None,
    reward_files: dict[str, str] | None = None,
) -> tuple[dict[str, float], str]:
    """What the new model must beat, on the same held-out set (and probe): the champion's scores, or the
    base's (preference accuracy against the same reference, the base this run tuned)."""
    if current is None:
        return evaluation.base, "base model"
    reference = Path(base_dir) if base_dir else None
    # cached per (champion files, data)
    rewards = RewardSet.of_run(cfg.training, reward_files or {})  # grpo: held-out prompts scored by the rewards
    scores, _ = score(full_model_dir_of(current), prepared, cfg.eval, reference=reference, rewards=rewards)
    return scores.values, f"champion v{current.version}"


def lineage_tags(
    cfg: LadleConfig,
    inputs: RunInputs,
    merged: MergedModel,
    evaluation: Evaluation,
    result: TrainResult,
    plan: Plan,
    flow_run_id: str,
) -> dict[str, str]:
    """What produced this version: the flow run, the data, the plan, the scores."""
    tags = {
        "ladle.flow_run_id": flow_run_id,
        "ladle.config_name": cfg.name,
        "ladle.data_fingerprint": inputs.data_fingerprint,
        lineage.TAG: inputs.fingerprint,
        lineage.PARTS_TAG: json.dumps(inputs.lineage),
        "ladle.data_path": cfg.data.path or ",".join(s.path for s in cfg.data.sources or []),
        "ladle.model_sha256": merged.sha256,
        "ladle.base": cfg.base,
        **({"ladle.base_version": inputs.base_version} if inputs.base_version else {}),
        "ladle.strategy": plan.strategy,
        "ladle.world_size": str(plan.world_size),
        "ladle.plan": json.dumps(
            {"strategy": plan.strategy, "world_size": plan.world_size, "global_batch": plan.global_batch_size}
        ),
        "ladle.steps": str(result.steps),
        "ladle.eval_metric": cfg.eval.metric,
    }
    if inputs.traffic is not None:  # lineage: the traffic window and counts this version learned from
        from ladle.data.traffic import TrafficReport
        from ladle.tasks.traffic import traffic_tags

        tags.update(traffic_tags(TrafficReport.model_validate(inputs.traffic)))
    tags.update({f"ladle.metric.{metric_key(k)}": repr(v) for k, v in evaluation.model.items()})
    tags.update({f"ladle.base_metric.{metric_key(k)}": repr(v) for k, v in evaluation.base.items()})
    return tags


@task(name="promote", retries=1, retry_delay_seconds=2, retry_condition_fn=retry_unless_user_error)
def promote_task(
    cfg: LadleConfig,
    inputs: RunInputs,
    merged: MergedModel,
    prepared: PreparedDataset,
    evaluation: Evaluation,
    endpoint: Endpoint,
    result: TrainResult,
    plan: Plan,
    tracking: Tracking,
    flow_run_id: str,
) -> gate.Decision:
    """Register (alias ``challenger``), compare with the champion on the same data, promote or not."""
    logger = get_run_logger()
    name = inputs.registered_model
    tags = lineage_tags(cfg, inputs, merged, evaluation, result, plan, flow_run_id)
    tags["ladle.smoke_answer_correct"] = str(endpoint.answer_correct)
    source = merged.url
    if not cfg.promote.merge and merged.adapter_url:  # the adapter itself, served on a server of its base
        source = merged.adapter_url
        tags.update(
            {
                "ladle.kind": "adapter",
                "ladle.model_sha256": merged.adapter_sha256 or "",
                "ladle.merged_sha256": merged.sha256,
                "ladle.merged_url": merged.url,
                "ladle.base_signature": merged.base_signature or "",
            }
        )
    parity_failure = None
    if endpoint.parity is not None:
        tags["ladle.parity"] = endpoint.parity.model_dump_json()
        if endpoint.parity.ok is False and cfg.promote.parity:
            parity_failure = endpoint.parity.where
    shadow_failure = shadow_win = None
    if endpoint.shadow is not None:
        tags["ladle.shadow"] = json.dumps({k: v for k, v in endpoint.shadow.items() if k != "worst"})
        shadow_failure = endpoint.shadow["reason"] if endpoint.shadow["regressed"] else None
        if endpoint.shadow["improved"]:
            shadow_win = (f"champion v{endpoint.shadow['champion_version']}", endpoint.shadow["reason"])
    metric = cfg.gate_metric()
    rule = gate.Rule(
        metric=metric,
        greater_is_better=cfg.eval.higher_wins() if metric == cfg.eval.metric else False,
        min_improvement=cfg.promote.min_improvement,
        max_probe_drop=cfg.promote.max_probe_drop,
        canary=canary_plan(cfg),
        parity_failure=parity_failure,
        shadow_failure=shadow_failure,
        shadow_win=shadow_win,
    )
    version, decision, current = gate.gate_and_promote(
        tracking.uri,
        name,
        source,
        evaluation.model,
        lambda champ: reference_scores(cfg, prepared, evaluation, champ, inputs.base_dir, inputs.reward_files),
        rule,
        run_id=tracking.run_id,
        tags=tags,
    )
    with promote.registry(tracking.uri, f"tagging MLflow run {tracking.run_id} with the decision"):
        mlflow = client(tracking.uri)
        mlflow.set_tag(tracking.run_id, "ladle.promotion", decision.reason)
        mlflow.set_tag(tracking.run_id, "ladle.registered_version", version.version)
    logger.info("%s v%s: %s", name, version.version, decision.reason)
    create_markdown_artifact(key="promotion", markdown=decision_markdown(name, version.version, decision))
    if decision.promoted:
        emit_promoted(name, version.version, decision.reason, previous=current.version if current else None)
    elif decision.canary:
        emit_canary(CANARY, name, version.version, decision.reason)
    return decision


def canary_plan(cfg: LadleConfig) -> str | None:
    """How the canary runs, in words (None: no canary; the gate promotes)."""
    canary = cfg.promote.canary
    if canary is None:
        return None
    return (
        f"it takes {canary.weight:.0%} of live traffic for {canary.duration_s:g} s where the champion is served "
        f"(the serving deployment or `ladle model serve`)"
    )


def decision_markdown(name: str, version: str, decision: gate.Decision) -> str:
    def fmt(value):
        return "-" if value is None else f"{value:.6g}"

    verdict = (
        "**promoted** to `champion`"
        if decision.promoted
        else "**canary next** (`champion` unchanged until it passes)"
        if decision.canary
        else "**not promoted** (`champion` unchanged)"
    )
    return "\n".join(
        [
            f"# {name} v{version}: {verdict}",
            "",
            "| | value |",
            "| --- | --- |",
            f"| metric | `{decision.metric}` ({'higher' if decision.greater_is_better else 'lower'} is better) |",
            f"| new model (v{version}) | {fmt(decision.candidate)} |",
            f"| {decision.against} | {fmt(decision.reference)} |",
            f"| improvement | {fmt(decision.improvement)} |",
            f"| needed | > {decision.min_improvement:g} |",
            *(
                [f"| probe (new / {decision.against}) | {fmt(decision.probe)} / {fmt(decision.probe_reference)} |"]
                if decision.probe is not None
                else []
            ),
            "",
            decision.reason,
        ]
    )
