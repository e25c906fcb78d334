"""``ladle run CONFIG``: the whole pipeline as a Prefect flow."""

from __future__ import annotations

import os
from typing import Optional

import typer
from rich.table import Table

from ladle.cli.common import console, deepspeed_override, exit_with_error, print_json
from ladle.errors import LadleError, find_ladle_error


def preflight(config: str, overrides: list[str], gpus: Optional[str]):
    """Load the config and check the machine, base and data before Prefect starts."""
    from ladle.config import load_config
    from ladle.plan import check_inputs, make_plan
    from ladle.topology import probe

    cfg = load_config(config, overrides, gpus)
    plan = make_plan(cfg, probe(), config, model=check_inputs(cfg))
    for warning in plan.warnings:
        console.print(f"[bold yellow]warning:[/] {warning}", highlight=False)
    return cfg


def run(
    config: str = typer.Argument(..., help="YAML config file (see recipes/)."),
    gpus: Optional[str] = typer.Option(None, "--gpus", help="'auto' or 1..128; overrides parallelism.gpus."),
    deepspeed: Optional[str] = typer.Option(None, "--deepspeed", help="zero1 | zero2 | zero3 | zero++ (alias zero_pp): sets parallelism.strategy."),
    set_: list[str] = typer.Option([], "--set", help="Override a field: --set training.lr=1e-4 (value parsed as YAML)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object as the last line."),
) -> None:
    """Run probe -> plan -> prepare -> train -> merge -> deploy."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    try:
        cfg = preflight(config, [*deepspeed_override(deepspeed), *set_], gpus)
    except LadleError as err:
        exit_with_error(str(err), as_json)
    from ladle.flows.finetune import finetune, install_log_filter

    install_log_filter()
    state = finetune(cfg, config_ref=config, return_state=True)
    if not state.is_completed():
        exc = state.result(raise_on_failure=False)
        user_error = find_ladle_error(exc if isinstance(exc, BaseException) else None)
        exit_with_error(str(user_error) if user_error else f"pipeline failed: {exc}", as_json, code=2 if user_error else 1)
    summary = state.result()
    if as_json:
        print_json(summary)
        return
    show_summary(summary)


def show_summary(summary: dict) -> None:
    table = Table(title="ladle run", show_header=False)
    for key in ("strategy", "world_size", "train_loss_first", "train_loss_last", "eval_loss_before", "eval_loss_after",
                "tokens_per_s", "output_url", "mlflow_run_id", "flow_run_id", "endpoint", "prompt", "answer"):  # fmt: skip
        value = summary[key]
        table.add_row(key, f"{value:.4f}" if isinstance(value, float) else str(value))
    console.print(table)
