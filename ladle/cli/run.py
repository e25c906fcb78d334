"""``ladle run CONFIG``: the whole pipeline as a Prefect flow."""

from __future__ import annotations

import signal
import sys

import typer
from rich.table import Table

from ladle.cli.common import CONFIG, DEEPSPEED, GPUS, JSON, SET, command, console, load, print_json
from ladle.errors import LadleError, find_ladle_error


def preflight(cfg, config: str):
    """Check the machine, base and data against the config before the flow starts."""
    from ladle.machine.topology import probe
    from ladle.plan.inputs import check_inputs
    from ladle.plan.planner import make_plan

    plan = make_plan(cfg, probe(), config, model=check_inputs(cfg))
    for warning in plan.warnings:
        console.print(f"[bold yellow]warning:[/] {warning}", highlight=False)
    return cfg


@command
def run(
    config: str = CONFIG,
    gpus: str | None = GPUS,
    deepspeed: str | None = DEEPSPEED,
    set_: list[str] = SET,
    run_id: str | None = typer.Option(
        None,
        "--run-id",
        help="Name of the run's folder. Run again with the same id after a crash or a cancel to resume from its "
        "last complete checkpoint.",
    ),
    skip_if_unchanged: bool = typer.Option(
        False,
        "--skip-if-data-unchanged",
        help="End at once, as 'skipped', when the champion was trained from the same data, base weights and training settings (one fingerprint).",
    ),
    as_json: bool = JSON,
) -> None:
    """Run probe -> plan -> prepare -> train -> merge -> evaluate -> deploy -> promote."""
    from ladle.assets import ladle_home
    from ladle.platform.prefect_api import PrefectApi
    from ladle.platform.startup import quiet_collector

    # A SIGTERM (a scheduler, systemd, kill) becomes an exception: the running stage stops its processes (the
    # training launcher and its ranks, a server) and the temporary Prefect API is stopped below. Python's default
    # would end this process on the spot and leave that server running.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    api = PrefectApi(ladle_home() / "logs")
    try:
        # The flow's libraries (Prefect, MLflow, torch, transformers) load with the collector paused.
        with quiet_collector():
            cfg = load(config, set_, gpus, deepspeed)
            # A config that parses is worth a server: it boots while the inputs are checked and the rest loads.
            api.start()
            preflight(cfg, config)
            warm_tracking_store(cfg)
            from ladle.flows.finetune import finetune, install_log_filter

        install_log_filter()
        with api.session():
            state = finetune(
                cfg,
                config_ref=config,
                run_id=run_id,
                skip_if_data_unchanged=skip_if_unchanged,
                return_state=True,
            )
    except LadleError as err:
        raise err.add_details(**api.timings()) from None
    finally:
        api.stop()
    if not state.is_completed():
        exc = state.result(raise_on_failure=False)
        user_error = find_ladle_error(exc if isinstance(exc, BaseException) else None)
        if user_error:
            raise user_error.add_details(**api.timings()) from None
        raise LadleError(f"pipeline failed: {exc}", details=api.timings(), exit_code=1)
    summary = {**state.result(), **api.timings()}
    if as_json:
        print_json(summary)
        return
    if summary["status"] == "skipped":
        console.print(summary["reason"], highlight=False)
        return
    show_summary(summary)


def warm_tracking_store(cfg) -> None:
    """Create (migrate) the MLflow store now, while an embedded Prefect server is still booting."""
    from ladle.lifecycle import tracking

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
        "probe_before",
        "probe_after",
        "probe_trend",
        "probe_guard",
        "promotion",
    )
    for key in keys:
        if key.startswith("probe_") and key not in summary:
            continue
        value = summary[key]
        if key == "probe_trend":
            value = " ".join(f"{score:g}@{step:g}" for step, score in value)
        table.add_row(key, f"{value:.4f}" if isinstance(value, float) else str(value))
    console.print(table)
