"""``ladle servers list|stop``: the servers running on this machine, from their run records."""

from __future__ import annotations

import time

import typer

from ladle.cli.common import JSON, command, console, print_json
from ladle.errors import LadleError

app = typer.Typer(help="Servers running on this machine: list them, or drain and stop one.", no_args_is_help=True)


@app.command("list")
@command
def list_(as_json: bool = JSON) -> None:
    """Every live server: pid, URL, model, backend, uptime."""
    from ladle.serve import records

    live = records.running()
    if as_json:
        print_json({"servers": live})
        return
    if not live:
        console.print("no server running")
    for r in live:
        up = time.time() - r["started_at"]
        console.print(
            f"{r['pid']:>7}  {r['url']:<26} {r['model']:<20} {r['backend']:<13} up {up:,.0f} s", highlight=False
        )


@app.command("stop")
@command
def stop(
    which: str = typer.Argument(None, help="The server's pid, model name or URL (see `ladle servers list`)."),
    all_: bool = typer.Option(False, "--all", help="Stop every running server."),
    grace_s: float = typer.Option(40.0, "--grace", help="Seconds to drain in-flight requests before SIGKILL."),
    as_json: bool = JSON,
) -> None:
    """SIGTERM (the server drains its in-flight requests), then SIGKILL after --grace."""
    from ladle.serve import records

    live = records.running()
    chosen = live if all_ else [r for r in live if which in (str(r["pid"]), r["model"], r["url"])]
    if not all_ and which is None:
        raise LadleError("SERVER: name the server to stop (pid, model or URL), or pass --all.")
    if not chosen and not all_:
        names = ", ".join(f"{r['pid']} ({r['model']})" for r in live) or "none is running"
        raise LadleError(f"SERVER = {which!r}: no such running server. Running: {names}.")
    outcome = {r["pid"]: records.stop(r, grace_s) for r in chosen}
    if as_json:
        print_json({"stopped": outcome})
        return
    for pid, how in outcome.items():
        console.print(f"{pid}: {how}", highlight=False)
