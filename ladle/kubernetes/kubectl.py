"""How ladle talks to a cluster, for training jobs and serving objects alike: one bounded ``kubectl`` call, and
what every pod it renders shares (its name's form, its resources, its placement)."""

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


def dns_label(name: str, limit: int) -> str:
    """``ladle-NAME`` as a DNS-1035 label of at most ``limit`` characters (controllers derive pod and service
    names from it, so callers leave room for their suffixes)."""
    clean = "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")
    return ("ladle-" + clean)[:limit].rstrip("-")


def resources(gpus: int, pods) -> dict[str, dict[str, str]] | None:
    """A container's requests and limits (equal): ``gpus`` NVIDIA GPUs and the section's CPU and memory; None
    when nothing is asked. ``pods`` is a ``KubernetesPods`` config section."""
    limits: dict[str, str] = {"nvidia.com/gpu": str(gpus)} if gpus else {}
    limits.update({k: v for k, v in (("cpu", pods.cpu), ("memory", pods.memory)) if v})
    return {"limits": limits, "requests": dict(limits)} if limits else None


def placement(pods) -> dict[str, Any]:
    """Where a pod lands and as whom: the section's tolerations, node selector and service account (each only
    when set)."""
    out: dict[str, Any] = {}
    if pods.tolerations:
        out["tolerations"] = pods.tolerations
    if pods.node_selector:
        out["nodeSelector"] = pods.node_selector
    if pods.service_account:
        out["serviceAccountName"] = pods.service_account
    return out
