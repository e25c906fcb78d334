"""``ladle recipes list|show|use NAME``: the shipped recipes."""

from __future__ import annotations

from pathlib import Path

import typer

from ladle.assets import recipe_path, shipped_recipes
from ladle.cli.common import JSON, command, console, print_json
from ladle.errors import LadleError

app = typer.Typer(help="Shipped recipes: list them, print one, or copy one to edit.", no_args_is_help=True)


def summary(path: Path) -> str:
    """The recipe's first descriptive comment line (after the usage line)."""
    lines = [line[1:].strip() for line in path.read_text(encoding="utf-8").splitlines() if line.startswith("#")]
    text = [line for line in lines[1:] if line]
    return text[0] if text else ""


@app.command("list")
@command
def list_(as_json: bool = JSON) -> None:
    """The shipped recipes, a line each."""
    recipes = {name: summary(path) for name, path in shipped_recipes().items()}
    if as_json:
        print_json(recipes)
        return
    for name, text in recipes.items():
        console.print(f"[bold]{name:<22}[/] {text}", highlight=False)


@app.command("show")
@command
def show(
    name: str = typer.Argument(..., help="Recipe name (see `ladle recipes list`)."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object: name, summary, path and the YAML text."),
) -> None:
    """Print a recipe's YAML."""
    path = recipe_path(name)
    text = path.read_text(encoding="utf-8")
    if as_json:
        print_json({"name": path.stem, "summary": summary(path), "path": str(path), "yaml": text})
        return
    print(text, end="")


@app.command("use")
@command
def use(
    name: str = typer.Argument(..., help="Recipe name (see `ladle recipes list`)."),
    to: Path | None = typer.Option(None, "--to", help="Where to write it (default: ./NAME.yaml)."),
    force: bool = typer.Option(False, "--force", help="Overwrite an existing file."),
) -> None:
    """Copy a recipe to edit (nothing is overwritten without --force)."""
    source = recipe_path(name)
    target = to or Path.cwd() / source.name
    if target.exists() and not force:
        raise LadleError(f"--to = {str(target)!r}: the file exists. Pass --force to overwrite it, or another --to.")
    target.write_text(source.read_text(encoding="utf-8"), encoding="utf-8")
    console.print(f"wrote {target}; plan it with: ladle plan {target}", highlight=False)
