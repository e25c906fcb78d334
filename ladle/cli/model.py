"""``ladle model list|rollback|canary|serve|status|stop``: the registered model's versions, aliases and serving."""

from __future__ import annotations

import datetime
import json
import os

import typer
from rich.table import Table

from ladle.cli.common import JSON, SET, command, console, load, print_json
from ladle.errors import LadleError
from ladle.platform.secrets import redact_url

app = typer.Typer(
    help="Registered models: versions and their metrics, the `champion` alias, rollback, and serving the champion.",
    no_args_is_help=True,
)
NAME = typer.Argument(..., help="Registered model name (the config's tracking.registered_model, or its name).")
URI = typer.Option(
    None,
    "--tracking-uri",
    help="MLflow tracking URI. Default: --config's store, else $MLFLOW_TRACKING_URI.",
)
CONFIG_OPT = typer.Option(None, "--config", "-c", help="A config or recipe whose MLflow store to use.")


def tracking_uri(uri: str | None, config: str | None) -> str:
    """Raises: LadleError: no way to find the MLflow store."""
    from ladle.lifecycle import tracking

    if uri:
        return tracking.strip_credentials(uri)
    if config:
        return tracking.tracking_uri(load(config, [], None, None))[0]
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return tracking.strip_credentials(os.environ["MLFLOW_TRACKING_URI"])
    raise LadleError(
        "--tracking-uri: no MLflow store named. Pass --tracking-uri URI, --config CONFIG (its store), "
        "or set MLFLOW_TRACKING_URI."
    )


@app.command("list")
@command
def list_(name: str = NAME, uri: str | None = URI, config: str | None = CONFIG_OPT, as_json: bool = JSON) -> None:
    """Every version, newest first: aliases, the gate metric, the decision, the data it was trained on; and the
    last scheduled run's decision (trained or skipped, and why)."""
    from ladle.lifecycle import promote, retraining

    store = tracking_uri(uri, config)
    found = promote.versions(store, name)
    if not found:
        raise LadleError(f"NAME = {name!r}: no registered model of that name at {redact_url(store)}.")
    rows = [
        {
            "version": v.version,
            "aliases": v.aliases,
            "metrics": v.metrics(),
            "promotion": v.tags.get("ladle.promotion.reason", ""),
            "data_fingerprint": v.tags.get("ladle.data_fingerprint"),
            "run_fingerprint": v.tags.get("ladle.run_fingerprint"),
            "flow_run_id": v.tags.get("ladle.flow_run_id"),
            "created": datetime.datetime.fromtimestamp(v.created_ms / 1000, datetime.UTC).isoformat(timespec="seconds"),
            "source": v.source,
            "kind": v.tags.get("ladle.kind", "merged"),
            "base_signature": v.tags.get("ladle.base_signature"),
            "parity": json.loads(v.tags["ladle.parity"]) if "ladle.parity" in v.tags else None,
        }
        for v in found
    ]
    check = retraining.retraining_check(store, name)
    held = None
    if any(row["kind"] == "adapter" for row in rows):
        from ladle.fleet.adapters import holders

        held = holders().get(name)
    if as_json:
        print_json(
            {
                "model": name,
                "champion_history": promote.history(store, name),
                "last_retraining_check": check,
                "served_on": held,
                "versions": rows,
            }
        )
        return
    table = Table(title=f"{name}")
    for column in ("version", "aliases", "metrics", "decision", "data", "created"):
        table.add_column(column)
    for row in rows:
        metrics = ", ".join(f"{k} {v:.4g}" for k, v in sorted(row["metrics"].items()))
        table.add_row(
            row["version"],
            ", ".join(row["aliases"]),
            metrics,
            row["promotion"],
            (row["data_fingerprint"] or "")[:12],
            row["created"],
        )
    console.print(table)
    if held is not None:
        versions = ", ".join(f"v{v} ({', '.join(a) or 'no alias'})" for v, a in held["versions"].items())
        console.print(f"served on {held['base']} at {held['front_url']}: {versions}", highlight=False)
    if check is not None:
        when = datetime.datetime.fromtimestamp(check["at"], datetime.UTC).isoformat(timespec="seconds")
        console.print(
            f"last scheduled run: {check['decision']} at {when} (flow run {check['flow_run_id']}): {check['reason']}",
            highlight=False,
        )


@app.command("rollback")
@command
def rollback(
    name: str = NAME,
    to: str | None = typer.Option(None, "--to", help="Version to make champion. Default: the previous champion."),
    uri: str | None = URI,
    config: str | None = CONFIG_OPT,
    as_json: bool = JSON,
) -> None:
    """Re-point `champion` (default: to the previous champion) and announce it, so serving swaps back."""
    from ladle.fleet.adapters import end_canary
    from ladle.fleet.champion import end_canary_at_front
    from ladle.lifecycle import promote

    store = tracking_uri(uri, config)
    before, after = promote.rollback(store, name, to)
    why = f"the operator rolled {name} back to v{after}"
    ended = end_canary_at_front(name, why) or end_canary(name, why)  # its own front's, or an adapter's at its base's
    event = announce(name, after, f"rollback from v{before}")
    told(
        {"model": name, "from": before, "to": after, "event_id": event, "canary_ended": ended},
        as_json,
        f"{name}: champion v{before} -> v{after}",
        f"run `ladle model serve CONFIG` to swap the local front to v{after}.",
    )


@app.command("canary")
@command
def canary(
    name: str = NAME,
    version: str = typer.Argument(..., help="The registered version to try on live traffic."),
    uri: str | None = URI,
    config: str | None = CONFIG_OPT,
    as_json: bool = JSON,
) -> None:
    """Give VERSION a canary: it becomes `challenger`, and where the champion is served with promote.canary it
    takes that share of live traffic until the front promotes it or rolls it back."""
    from ladle.lifecycle import promote
    from ladle.lifecycle.events import CANARY

    store = tracking_uri(uri, config)
    target = promote.mark_canary(store, name, version)
    event = announce(name, target.version, f"canary of v{target.version} asked by hand", CANARY)
    told(
        {"model": name, "version": target.version, "event_id": event},
        as_json,
        f"{name}: v{target.version} waits for its canary",
        "run `ladle model serve CONFIG` (a config with promote.canary) to run it.",
    )


def told(result: dict, as_json: bool, line: str, unheard: str) -> None:
    """The result of a command that announced an event: JSON, or ``line`` and, when no Prefect API took the
    event, ``unheard`` (what to run instead)."""
    if as_json:
        print_json(result)
        return
    console.print(line, highlight=False)
    if result["event_id"] is None:
        console.print(
            f"no Prefect API is configured (PREFECT_API_URL), so no serving deployment heard it; {unheard}",
            highlight=False,
        )


def announce(name: str, version: str, reason: str, event: str | None = None) -> str | None:
    """Emit ``ladle.model.promoted`` (or ``event``: ``ladle.model.canary``) to the configured Prefect API; None
    when there is none."""
    if not os.environ.get("PREFECT_API_URL"):
        return None
    from ladle.lifecycle.events import emit_canary, emit_promoted

    return emit_promoted(name, version, reason) if event is None else emit_canary(event, name, version, reason)


@app.command("serve")
@command
def serve(
    config: str = typer.Argument(..., help="The config or recipe whose registered model and serve.* to use."),
    set_: list[str] = SET,
    as_json: bool = JSON,
) -> None:
    """Serve the champion on serve.front_port, or swap the front to it: start, check, switch, drain the old. An
    adapter (promote.merge: false) goes on the server of its base, beside that base's other adapters."""
    from ladle.fleet import adapters
    from ladle.lifecycle import tracking

    cfg = load(config, set_, None, None)
    uri, _ = tracking.tracking_uri(cfg)
    from ladle.plan.inputs import base_dir_of

    name = cfg.tracking.registered_model or cfg.name
    served, line = adapters.serve_registered(uri, name, cfg, lambda: base_dir_of(cfg))
    if as_json:
        print_json(served)
        return
    console.print(line, highlight=False)


@app.command("status")
@command
def status(name: str = NAME, as_json: bool = JSON) -> None:
    """The front of NAME on this machine: its address and the version behind it."""
    from ladle.fleet import champion
    from ladle.fleet import front as router

    front = router.read_record(name)
    if front is None:
        raise LadleError(f"NAME = {name!r}: no front is serving it on this machine. Start one: `ladle model serve`.")
    upstream = champion.current_upstream(front)
    result = {"model": name, "front_url": front["url"], "front_pid": front["pid"], "upstream": upstream}
    if as_json:
        print_json(result)
        return
    behind = f"v{upstream['version']} at {upstream['url']} (pid {upstream['pid']})" if upstream else "nothing yet"
    console.print(f"{name}: {front['url']} -> {behind}", highlight=False)


@app.command("stop")
@command
def stop(name: str = NAME, as_json: bool = JSON) -> None:
    """Drain and stop NAME's front and the server behind it."""
    from ladle.fleet import champion

    result = champion.stop(name)
    if as_json:
        print_json(result)
        return
    console.print(f"stopped {name}: front {result['front']}, server pid {result['server_pid']}", highlight=False)
