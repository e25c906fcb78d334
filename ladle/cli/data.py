"""``ladle data prepare|inspect|show-mask CONFIG``: the prepare stage on its own."""

from __future__ import annotations

import typer
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from ladle.cli.common import CONFIG, JSON, SET, command, console, load, print_json

app = typer.Typer(help="Prepare and look at training data.", no_args_is_help=True)


@app.command("prepare")
@command
def prepare_cmd(config: str = CONFIG, set_: list[str] = SET, as_json: bool = JSON) -> None:
    """Prepare the dataset into the artifact store and print its report."""
    from ladle.data.prepare import prepare
    from ladle.plan.inputs import base_dir_of
    from ladle.platform import storage

    cfg = load(config, set_)
    columns = (SpinnerColumn(), TextColumn("preparing: {task.fields[rows]:,} records read"), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("prepare", rows=0)
        prepared = prepare(
            cfg.data,
            base_dir_of(cfg),
            storage.normalise(cfg.output),
            on_progress=lambda rows: progress.update(task, rows=rows),
            objective=cfg.training.objective,
            reward_columns=reward_columns(cfg),
        )
    report = prepared.report.model_dump()
    if as_json:
        print_json({**report, "url": prepared.url, "fingerprint": prepared.fingerprint})
        return
    table = Table(title=f"data report ({prepared.url})", show_header=False)
    for key, value in report.items():
        if key not in ("dropped", "length_histogram", "sources", "mix"):
            table.add_row(key, str(value))
    table.add_row("dropped", str(len(report["dropped"])))
    console.print(table)
    if report.get("mix"):
        console.print(mix_table(report["mix"]))
    for item in report["dropped"][:20]:
        console.print(f"  line {item['line']} of {item['source']}: {item['reason']}", highlight=False)


def mix_table(mix: list[dict]) -> Table:
    """data.sources: each source's ask, its rows and its share, asked against achieved."""
    table = Table(title="mix (data.sources)")
    for name in ("source", "asked", "records", "held out", "dropped", "used", "passes", "asked share", "achieved"):
        table.add_column(name, justify="left" if name in ("source", "asked") else "right")
    for m in mix:
        asked = next(f"{key} {m[key]:g}" for key in ("weight", "rows", "epochs") if key in m)
        table.add_row(
            m["name"],
            asked,
            f"{m['training_records']:,}",
            f"{m['held_out']:,}",
            f"{m['dropped']:,}",
            f"{m['train_examples']:,}",
            f"{m['passes']:g}",
            f"{m['asked_share']:.1%}",
            f"{m['achieved_share']:.1%} ({m['token_share']:.1%} of tokens)",
        )
    return table


def reward_columns(cfg) -> list[str] | None:
    """grpo: the columns the rewards read (checked present in every row, named in the report)."""
    if cfg.training.objective != "grpo":
        return None
    from ladle import rewards

    return rewards.columns_needed(cfg.training.rl.rewards, rewards.bundle(cfg.training.rl.rewards))


@app.command("inspect")
@command
def inspect_cmd(
    config: str = CONFIG,
    n: int = typer.Option(3, "-n", help="Samples to show."),
    set_: list[str] = SET,
    as_json: bool = JSON,
) -> None:
    """Files, detected format, record counts, the commonest problems, and a few parsed samples."""
    from ladle.data.inspect import inspect

    cfg = load(config, set_)
    info = inspect(cfg.data, n, cfg.training.objective)
    if as_json:
        print_json(info)
        return
    for file in info["files"]:
        console.print(f"{file['url']}  ({file['kind']}, {file['bytes']:,} bytes)", highlight=False)
    console.print(f"format: {info['format']}   records: {info['records']:,}   invalid: {info['invalid']:,}")
    for problem in info["top_problems"]:
        console.print(f"  {problem['count']:>6} x {problem['reason']}", highlight=False)
    for sample in info["samples"]:
        console.print(f"[bold]line {sample['line']}[/]: {sample['sample']}", highlight=False)


@app.command("show-mask")
@command
def show_mask_cmd(
    config: str = CONFIG,
    n: int = typer.Option(3, "-n", help="Rows to show."),
    set_: list[str] = SET,
    as_json: bool = JSON,
) -> None:
    """Render sample rows with the trained tokens highlighted (the trainer's own tokenization)."""
    from ladle.data.inspect import mask_rows
    from ladle.plan.inputs import base_dir_of

    cfg = load(config, set_)
    rows = mask_rows(cfg.data, base_dir_of(cfg), n, cfg.training.objective)
    if as_json:
        print_json({"rows": rows})
        return
    for row in rows:
        console.print(
            f"[bold]line {row['line']}[/] of {row['source']}: {row['trained']}/{row['total']} tokens trained"
            + (" (truncated)" if row["truncated"] else ""),
            highlight=False,
        )
        text = Text()
        for piece, trained in row["tokens"]:
            text.append(piece, style="bold black on green" if trained else "dim")
        console.print(text)
        console.print()


def day(value: str | None, flag: str):
    """``--since``/``--until`` as a date, or the error naming the flag, the value and the form."""
    from datetime import date

    from ladle.errors import LadleError

    if value is None:
        return None
    try:
        return date.fromisoformat(value)
    except ValueError:
        raise LadleError(f"{flag} = {value!r}: not a day; give it as YYYY-MM-DD (e.g. 2026-12-01).") from None


@app.command("from-traffic")
@command
def from_traffic_cmd(
    config: str = CONFIG,
    since: str = typer.Option(None, "--since", help="Oldest capture day used (YYYY-MM-DD). Default: retrain.since."),
    until: str = typer.Option(None, "--until", help="Newest capture day used (YYYY-MM-DD). Default: today."),
    model: str = typer.Option(None, "--model", help="Only the traffic this served model (or adapter) answered."),
    traffic: str = typer.Option(
        None, "--traffic", help="Where the server captured to. Default: retrain.traffic_url, serve.capture.url."
    ),
    out: str = typer.Option(None, "--out", help="Folder for the rows. Default: output/traffic-data/<digest>."),
    set_: list[str] = SET,
    as_json: bool = JSON,
) -> None:
    """Turn the server's captured traffic and its users' feedback into training rows (sft, dpo, kto, grpo), without
    duplicates or overlap with the evaluation set, and print the data.sources entry to add to the recipe."""
    from ladle.data.traffic import KINDS, curate

    cfg = load(config, set_)
    report = curate(
        cfg, traffic, day(since, "--since"), day(until, "--until"), model, out, reward_columns=reward_columns(cfg)
    )
    if as_json:
        print_json(report.model_dump())
        return
    table = Table(title=f"traffic ({report.traffic_url})", show_header=False)
    table.add_row("window", f"{report.first_at} .. {report.last_at}")
    table.add_row("requests", f"{report.requests:,} ({report.with_feedback:,} with feedback)")
    table.add_row("feedback", f"{report.feedback:,} ({report.feedback_unmatched:,} on answers not captured here)")
    for kind in KINDS:
        table.add_row(f"{kind} rows", f"{report.rows.get(kind, 0):,}  {report.files.get(kind, '')}")
    console.print(table)
    for reason, count in report.dropped.items():
        console.print(f"  dropped {count:>6} x {reason}", highlight=False)
    for prompt in report.overlap_examples:
        console.print(f"  overlaps the evaluation set: {prompt!r}", highlight=False)
    if report.sources:
        import yaml

        entry = yaml.safe_dump({"data": {"sources": report.sources}}, sort_keys=False)
        console.print(
            "Add to the recipe (beside its own data, as a data.sources entry), or set retrain.from_traffic=true:\n"
            + entry,
            highlight=False,
            soft_wrap=True,
        )
    else:
        console.print(f"no {cfg.training.objective} rows from this traffic.", highlight=False)
