"""Shared CLI plumbing: one error path, one JSON path."""

from __future__ import annotations

import json
import sys
from typing import NoReturn

from rich.console import Console

from ladle.errors import LadleError

console = Console(stderr=True)


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


DEEPSPEED_CHOICES = {
    "1": "zero1",
    "2": "zero2",
    "3": "zero3",
    "zero1": "zero1",
    "zero2": "zero2",
    "zero3": "zero3",
    "zero++": "zero++",
    "zero_pp": "zero++",
    "zeropp": "zero++",
}


def deepspeed_override(value: str | None) -> list[str]:
    """``--deepspeed STAGE`` as a ``--set parallelism.strategy=...`` override.

    Raises:
        LadleError: an unknown stage name.
    """
    from ladle.errors import LadleError

    if value is None:
        return []
    name = DEEPSPEED_CHOICES.get(value.strip().lower())
    if name is None:
        raise LadleError(
            f"--deepspeed = {value!r}: unknown ZeRO stage. Use zero1, zero2, zero3 or zero++ (alias zero_pp)."
        )
    return [f"parallelism.strategy={name}"]
