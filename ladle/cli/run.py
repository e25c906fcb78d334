"""``ladle run CONFIG``: the whole pipeline as a Prefect flow."""

from __future__ import annotations

import typer
from rich.table import Table

from ladle.cli.common import console, deepspeed_override, exit_with_error, fail, print_json
from ladle.errors import LadleError, find_ladle_error


def preflight(cfg, config: str):
    """Check the machine, base and data against the config before the flow starts."""
    from ladle.plan import check_inputs, make_plan
    from ladle.topology import probe

    plan = make_plan(cfg, probe(), config, model=check_inputs(cfg))
    for warning in plan.warnings:
        console.print(f"[bold yellow]warning:[/] {warning}", highlight=False)
    return cfg


def run(
    config: str = typer.Argument(..., help="YAML config file (see recipes/)."),
    gpus: str | None = typer.Option(None, "--gpus", help="'auto' or 1..128; overrides parallelism.gpus."),
    deepspeed: str | None = typer.Option(
        None, "--deepspeed", help="zero1 | zero2 | zero3 | zero++ (alias zero_pp): sets parallelism.strategy."
    ),
    set_: list[str] = typer.Option(
        [], "--set", help="Override a field: --set training.lr=1e-4 (value parsed as YAML)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object as the last line."),
) -> None:
    """Run probe -> plan -> prepare -> train -> merge -> evaluate -> deploy."""
    from ladle.assets import ladle_home
    from ladle.config import load_config
    from ladle.flows.api import PrefectApi

    api = None
    try:
        api = PrefectApi(ladle_home() / "logs")
        cfg = load_config(config, [*deepspeed_override(deepspeed), *set_], gpus)
        # A config that parses is worth a server: it boots while the inputs are checked and the rest loads.
        api.start()
        preflight(cfg, config)
        warm_tracking_store(cfg)
        from ladle.flows.finetune import finetune, install_log_filter

        install_log_filter()
        with api.session():
            state = finetune(cfg, config_ref=config, return_state=True)
    except LadleError as err:
        fail(err, as_json, **(api.timings() if api else {}))
    finally:
        if api is not None:
            api.stop()
    if not state.is_completed():
        exc = state.result(raise_on_failure=False)
        user_error = find_ladle_error(exc if isinstance(exc, BaseException) else None)
        if user_error:
            fail(user_error, as_json, **api.timings())
        exit_with_error(f"pipeline failed: {exc}", as_json, code=1, details=api.timings())
    summary = {**state.result(), **api.timings()}
    if as_json:
        print_json(summary)
        return
    show_summary(summary)


def warm_tracking_store(cfg) -> None:
    """Create (migrate) the MLflow store now, while an embedded Prefect server is still booting."""
    from ladle import tracking

    uri, _ = tracking.tracking_uri(cfg)
    tracking.client(uri).search_experiments(max_results=1)


def show_summary(summary: dict) -> None:
    table = Table(title="ladle run", show_header=False)
    keys = (
        "strategy",
        "world_size",
        "train_loss_first",
        "train_loss_last",
        "eval_loss_before",
        "eval_loss_after",
        "eval_accuracy_before",
        "eval_accuracy_after",
        "eval_examples",
        "tokens_per_s",
        "output_url",
        "mlflow_run_id",
        "flow_run_id",
        "endpoint",
        "prompt",
        "answer",
        "expected",
        "answer_correct",
    )
    for key in keys:
        value = summary[key]
        table.add_row(key, f"{value:.4f}" if isinstance(value, float) else str(value))
    console.print(table)
