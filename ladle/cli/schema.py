"""``ladle schema [--markdown]``: the config's JSON schema, or its markdown reference."""

from __future__ import annotations

import json

import typer


def schema(
    markdown: bool = typer.Option(False, "--markdown", help="A reference table instead of JSON schema."),
) -> None:
    """Print the config's JSON schema (for editors), or its markdown reference."""
    from ladle.config import json_schema, markdown_reference

    print(markdown_reference() if markdown else json.dumps(json_schema(), indent=2), end="" if markdown else "\n")
