"""``ladle env [--json]``: what a bug report needs (versions, Python, GPUs)."""

from __future__ import annotations

import platform
import sys
from importlib import metadata

from ladle.cli.common import JSON, command, console, print_json

PACKAGES = (
    "ladle",
    "torch",
    "transformers",
    "peft",
    "accelerate",
    "deepspeed",
    "prefect",
    "mlflow",
    "fsspec",
    "s3fs",
    "pydantic",
    "fastapi",
    "uvicorn",
)


@command
def env(as_json: bool = JSON) -> None:
    """What a bug report needs: versions, Python, GPUs."""
    from ladle.machine.topology import probe

    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    topo = probe()
    info = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "packages": versions,
        "topology": topo.model_dump(),
    }
    if as_json:
        print_json(info)
        return
    console.print(f"python {info['python']} on {info['platform']}")
    for name, version in versions.items():
        console.print(f"  {name:<13} {version or 'not installed'}")
    console.print(f"GPUs: {topo.gpu_count} ({topo.source}); CPU cores: {topo.cpu_count}")
    for warning in topo.warnings:
        console.print(f"[bold yellow]warning:[/] {warning}", highlight=False)
