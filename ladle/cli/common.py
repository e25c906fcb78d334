"""Shared CLI plumbing: the options every command declares the same way, one error path, one JSON path.

A command is a plain function decorated with ``@command``: a ``LadleError`` it raises becomes one
``error: ...`` line on stderr (and, with ``--json``, a ``{"status": "failed", ...}`` object as the last
stdout line) and its exit code, never a traceback.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from typing import NoReturn, TypeVar

import typer
from rich.console import Console

from ladle import strategies
from ladle.errors import LadleError, store_outage

console = Console(stderr=True)
F = TypeVar("F", bound=Callable)


def deepspeed_names() -> dict[str, str]:
    """What ``--deepspeed`` accepts: each strategy DeepSpeed runs, by name, alias or stage shortcut."""
    return {
        name: s.name
        for s in strategies.REGISTRY.values()
        if s.engine == "deepspeed"
        for name in (s.name, *s.aliases, *s.shortcuts)
    }


def deepspeed_help() -> str:
    runs = [s for s in strategies.REGISTRY.values() if s.engine == "deepspeed"]
    choices = " | ".join(s.name + (f" (alias {', '.join(s.aliases)})" if s.aliases else "") for s in runs)
    return f"{choices}: sets parallelism.strategy."


CONFIG = typer.Argument(..., help="YAML config file (see recipes/).")
SET = typer.Option([], "--set", help="Override a field: --set training.lr=1e-4 (value parsed as YAML).")
GPUS = typer.Option(None, "--gpus", help="'auto' or 1..128; overrides parallelism.gpus.")
DEEPSPEED = typer.Option(None, "--deepspeed", help=deepspeed_help())
JSON = typer.Option(False, "--json", help="One JSON object as the last line of stdout.")


def command(fn: F) -> F:
    """Run ``fn``; a ``LadleError`` becomes the one-line error (and ``--json`` failure object) and exit code."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except LadleError as err:
            fail(err, bool(kwargs.get("as_json", False)), code=err.exit_code)
        except Exception as exc:
            outage = store_outage(exc)  # an object store past its deadline is an outage to name, not a bug
            if outage is None:
                raise
            fail(outage, bool(kwargs.get("as_json", False)), code=outage.exit_code)

    return wrapper  # type: ignore[return-value]


def exit_with_error(message: str, as_json: bool = False, code: int = 2, details: dict | None = None) -> NoReturn:
    """Print ``error: message`` and exit non-zero, without a traceback.

    With ``--json`` the last stdout line is ``{"status": "failed", "error": ..., **details}``:
    whatever was computed before the failure travels with it.
    """
    if as_json:
        sys.stdout.flush()
        print(json.dumps({"status": "failed", "error": message, **(details or {})}, default=str), flush=True)
    console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise SystemExit(code)


def fail(err: LadleError, as_json: bool = False, code: int = 2, **computed) -> NoReturn:
    """``exit_with_error`` for a ``LadleError``: its message, plus ``computed`` and the error's own details."""
    exit_with_error(str(err), as_json, code, {**computed, **err.details})


def print_json(obj) -> None:
    """The last line on stdout: one JSON object."""
    sys.stdout.flush()
    print(json.dumps(obj, default=str), flush=True)


def load(config: str, overrides: list[str], gpus: str | None = None, deepspeed: str | None = None):
    """The config with ``--deepspeed``, ``--set`` and ``--gpus`` applied.

    Raises:
        LadleError: the file, an override or the resulting tree is invalid.
    """
    from ladle.config import load_config

    cfg = load_config(config, [*deepspeed_override(deepspeed), *overrides], gpus)
    for note in cfg.notes:
        console.print(f"[bold yellow]note:[/] {note}", highlight=False, soft_wrap=True)
    from ladle.lifecycle import tracking

    tracking.apply_deadlines(cfg)  # every command that reaches MLflow or the artifact store is bounded
    return cfg


def deepspeed_override(value: str | None) -> list[str]:
    """``--deepspeed NAME`` as a ``--set parallelism.strategy=...`` override.

    Raises:
        LadleError: a name no DeepSpeed strategy answers to.
    """
    if value is None:
        return []
    names = deepspeed_names()
    name = names.get(value.strip().lower())
    if name is None:
        choices = ", ".join(dict.fromkeys(names.values()))
        raise LadleError(f"--deepspeed = {value!r}: unknown ZeRO stage. Use {choices} (or the stage number).")
    return [f"parallelism.strategy={name}"]
