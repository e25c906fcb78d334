"""The ``ladle`` command: thin handlers that call the library, one module per command or group."""

from __future__ import annotations

import typer

from ladle.cli import data, k8s, model, recipes, servers
from ladle.cli.env import env
from ladle.cli.launch import launch
from ladle.cli.plan import plan
from ladle.cli.probe import probe
from ladle.cli.run import run
from ladle.cli.schema import schema
from ladle.cli.serve import serve
from ladle.platform.startup import raise_thresholds

app = typer.Typer(
    name="ladle",
    help="Fine-tune a model from a YAML file and serve it: probe -> plan -> prepare -> train -> merge -> "
    "evaluate -> deploy.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
for handler in (run, plan, probe, launch, schema, env, serve):
    app.command(handler.__name__)(handler)
app.add_typer(data.app, name="data")
app.add_typer(recipes.app, name="recipes")
app.add_typer(servers.app, name="servers")
app.add_typer(model.app, name="model")
app.add_typer(k8s.app, name="k8s")


def main() -> None:
    """The ``ladle`` command: the app, with the collector's thresholds raised first (each handler imports the
    libraries it uses as it runs: ``ladle.platform.startup.raise_thresholds``)."""
    raise_thresholds()
    app()


if __name__ == "__main__":
    main()
