"""Prefect task: validate the config against the machine and plan the run."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact

from ladle.config import LadleConfig, flatten
from ladle.lifecycle.tracking import Tracking, log_json, log_params
from ladle.machine.topology import Topology
from ladle.plan.planner import Plan, make_plan


@task(name="validate-and-plan", timeout_seconds=600)
def plan_task(cfg: LadleConfig, topo: Topology, base_config: dict, tracking: Tracking, config_ref: str) -> Plan:
    plan = make_plan(cfg, topo, config_ref, model=base_config)
    logger = get_run_logger()
    for line in plan.reasons + plan.overrides:
        logger.info("plan: %s", line)
    for line in plan.warnings:
        logger.warning("plan: %s", line)
    log_params(
        tracking,
        flatten(
            plan.model_dump(mode="json", exclude={"reasons", "overrides", "warnings", "candidates", "launcher_config"})
        ),
        prefix="plan.",
    )
    log_json(tracking, "plan.json", plan.model_dump(mode="json"))
    create_markdown_artifact(key="plan", markdown=plan.to_markdown(), description="Training plan and its reasons")
    return plan
