"""``ladle recipes list|show|use NAME``: the shipped recipes."""

from __future__ import annotations

import re
from pathlib import Path

import typer

from ladle.cli.common import console, exit_with_error, print_json

app = typer.Typer(help="Shipped recipes: list them, print one, or copy one to edit.", no_args_is_help=True)
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


def recipes_dir() -> Path:
    from ladle.assets import RECIPES_DIR

    return RECIPES_DIR


def available() -> dict[str, Path]:
    return {p.stem: p for p in sorted(recipes_dir().glob("*.yaml"))}


def summary(path: Path) -> str:
    """The recipe's first descriptive comment line (after the usage line)."""
    lines = [line[1:].strip() for line in path.read_text(encoding="utf-8").splitlines() if line.startswith("#")]
    text = [line for line in lines[1:] if line]
    return text[0] if text else ""


def find(name: str, as_json: bool = False) -> Path:
    """The recipe called ``name``; names are plain words, never paths.

    Raises:
        SystemExit: the name is not a recipe name, or no recipe has it.
    """
    if not NAME.match(name) or name.endswith(".yaml") and not NAME.match(name[:-5]):
        exit_with_error(
            f"NAME = {name!r}: a recipe name is letters, digits, '.', '_' or '-' (no paths). See `ladle recipes list`.",
            as_json,
        )
    recipes = available()
    path = recipes.get(name.removesuffix(".yaml"))
    if path is None:
        exit_with_error(
            f"NAME = {name!r}: no such recipe. Choose one of: {', '.join(recipes)}.",
            as_json,
            details={"recipes": list(recipes)},
        )
    return path


@app.command("list")
def list_(as_json: bool = typer.Option(False, "--json", help="One JSON object.")) -> None:
    """The shipped recipes, a line each."""
    recipes = {name: summary(path) for name, path in available().items()}
    if as_json:
        print_json(recipes)
        return
    for name, text in recipes.items():
        console.print(f"[bold]{name:<22}[/] {text}", highlight=False)


@app.command("show")
def show(
    name: str = typer.Argument(..., help="Recipe name (see `ladle recipes list`)."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object: name, summary, path and the YAML text."),
) -> None:
    """Print a recipe's YAML."""
    path = find(name, as_json)
    text = path.read_text(encoding="utf-8")
    if as_json:
        print_json({"name": path.stem, "summary": summary(path), "path": str(path), "yaml": text})
        return
    print(text, end="")


@app.command("use")
def use(
    name: str = typer.Argument(..., help="Recipe name (see `ladle recipes list`)."),
    to: Path | None = typer.Option(None, "--to", help="Where to write it (default: ./NAME.yaml)."),
    force: bool = typer.Option(False, "--force", help="Overwrite an existing file."),
) -> None:
    """Copy a recipe to edit (nothing is overwritten without --force)."""
    source = find(name)
    target = to or Path.cwd() / source.name
    if target.exists() and not force:
        exit_with_error(f"--to = {str(target)!r}: the file exists. Pass --force to overwrite it, or another --to.")
    target.write_text(source.read_text(encoding="utf-8"), encoding="utf-8")
    console.print(f"wrote {target}; plan it with: ladle plan {target}", highlight=False)
