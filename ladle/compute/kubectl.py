"""One bounded ``kubectl`` call: how ladle talks to a cluster, for training jobs and for serving objects."""

from __future__ import annotations

import json
import subprocess
from typing import Any

from ladle.errors import LadleError


def run(*args: str, stdin: str | None = None, timeout: float = 60, missing: str) -> subprocess.CompletedProcess:
    """``kubectl ARGS``; a call that outlives ``timeout`` reads as a failed one (exit 124).

    Raises:
        LadleError: kubectl is not on PATH (``missing`` says what needed it and what to do instead).
    """
    try:
        return subprocess.run(
            ["kubectl", *args], input=stdin, capture_output=True, text=True, timeout=timeout, check=False
        )
    except FileNotFoundError:
        raise LadleError(f"kubectl not found on PATH: {missing}") from None
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(
            ["kubectl", *args], 124, "", f"kubectl {args[0]}: no answer in {timeout:g} s"
        )


def parsed(done: subprocess.CompletedProcess) -> dict[str, Any] | None:
    """A ``kubectl get -o json`` answer, parsed; None when kubectl failed or said nothing."""
    if done.returncode != 0 or not done.stdout.strip():
        return None
    return json.loads(done.stdout)
