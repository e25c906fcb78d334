"""ladle installs as a normal wheel: built from this tree, installed (not editable) into a fresh
environment, and run from another folder with the source tree out of reach, its recipes and shipped
model configs are found as package data."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.helpers import NVSWITCH_8, ROOT

pytestmark = pytest.mark.pipeline


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh venv holding the wheel; its dependencies are read from this environment's site-packages,
    listed in a .pth file (whose own .pth files, the editable install among them, are not processed)."""
    root = tmp_path_factory.mktemp("wheel")
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(root), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = root.glob("ladle-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for expected in (
        "ladle/recipes/tiny-cpu.yaml",
        "ladle/recipes/llama3-70b-fsdp2.yaml",
        "ladle/recipes/models/llama-3.1-70b/config.json",
        "ladle/flows/finetune.py",
        "ladle/tasks/train.py",
        "ladle/strategies/fsdp2.py",
        "ladle/train/runtime/pipeline_stage.py",
    ):
        assert expected in names, sorted(names)[:40]
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    target = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(target, "ladle-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(venv / "bin" / "python"),
            "install",
            "--no-deps",
            "--no-index",
            "-q",
            str(wheel),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return venv


def ladle(venv: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(
        [str(venv / "bin" / "ladle"), *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=300
    )


def test_the_wheel_runs_without_the_source_tree(installed, tmp_path):
    where = subprocess.run(
        [str(installed / "bin" / "python"), "-c", "import ladle.recipes; print(ladle.recipes.__file__)"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        check=True,
    ).stdout
    assert where.startswith(str(installed)) and str(ROOT) not in where

    listed = ladle(installed, tmp_path, "recipes", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    assert {"tiny-cpu", "llama3-70b-fsdp2", "qwen3-32b-zeropp"} <= set(json.loads(listed.stdout.splitlines()[-1]))

    shown = ladle(installed, tmp_path, "recipes", "show", "llama3-70b-fsdp2")
    assert shown.returncode == 0 and "base: ladle://models/llama-3.1-70b" in shown.stdout, shown.stderr

    topo = tmp_path / "topo.txt"
    topo.write_text(NVSWITCH_8)
    planned = ladle(
        installed, tmp_path, "plan", "llama3-70b-fsdp2", "--topology-file", str(topo), "--gpu-memory", "80", "--json"
    )
    assert planned.returncode == 0, planned.stderr[-2000:]
    plan = json.loads(planned.stdout.splitlines()[-1])
    # The size came from the shipped ladle://models/llama-3.1-70b config.json, read from the installed package.
    assert plan["strategy"] == "fsdp2" and plan["params"] > 70e9 and plan["world_size"] == 8
