"""Helpers shared by the benchmarks: machine description and result files."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
from pathlib import Path

OUT = Path(__file__).resolve().parent / "out"


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores ({cpu}), Python {platform.python_version()}"


def save(name: str, payload: dict) -> Path:
    OUT.mkdir(parents=True, exist_ok=True)
    payload = {"machine": machine(), "date": dt.date.today().isoformat(), **payload}
    path = OUT / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2))
    return path
