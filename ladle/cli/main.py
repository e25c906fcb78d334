"""The ``ladle`` command: thin handlers that call the library."""

from __future__ import annotations

import typer

from ladle.cli import data, info, recipes
from ladle.cli.launch import launch
from ladle.cli.probe import probe
from ladle.cli.run import run

app = typer.Typer(
    name="ladle",
    help="Fine-tune a model from a YAML file and serve it: probe -> plan -> prepare -> train -> merge -> deploy.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.command("run")(run)
app.command("plan")(info.plan)
app.command("probe")(probe)
app.command("launch")(launch)
app.command("schema")(info.schema)
app.command("env")(info.env)
app.command("serve")(info.serve)
app.add_typer(data.app, name="data")
app.add_typer(recipes.app, name="recipes")

if __name__ == "__main__":
    app()
