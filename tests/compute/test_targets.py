"""Compute targets without a cluster: the batch script rendered from a GPU plan, and bad settings refused before
anything is submitted, each naming the field, the value and the fix."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ladle import compute
from ladle.config import build_config
from ladle.errors import ConfigError
from ladle.machine.topology import probe, probe_file
from ladle.plan.planner import make_plan
from tests.compute.test_kubernetes import EIGHT_GPUS

BASE = {"base": "ladle://tiny-llama", "data": {"path": "ladle://demo-alpaca"}}


def cfg_with(**sections):
    return build_config({**BASE, **sections}, [])


def test_the_batch_script_asks_for_what_the_gpu_plan_needs():
    cfg = cfg_with(
        parallelism={"nodes": 4},
        compute={
            "target": "slurm",
            "slurm": {
                "partition": "h100",
                "account": "ml",
                "qos": "high",
                "time_limit": "1-12:00:00",
                "cpus_per_task": 96,
                "setup": ["module load cuda/12.8", "source /shared/ladle/.venv/bin/activate"],
                "sbatch_args": ["--exclusive", "--constraint=ib"],
                "python": "/shared/ladle/.venv/bin/python",
            },
        },
    )
    plan = make_plan(cfg, probe_file(str(EIGHT_GPUS), gpu_memory_gib=24))
    script = compute.get(cfg).script("/shared/runs/r/spec.json", plan, "/shared/logs/train-%j.out")
    for line in (
        "#SBATCH --nodes=4",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gres=gpu:8",
        "#SBATCH --partition=h100",
        "#SBATCH --account=ml",
        "#SBATCH --qos=high",
        "#SBATCH --time=1-12:00:00",
        "#SBATCH --cpus-per-task=96",
        "#SBATCH --exclusive",
        "#SBATCH --constraint=ib",
        "#SBATCH --output=/shared/logs/train-%j.out",
        "module load cuda/12.8",
        "srun --nodes=4 --ntasks=4 --ntasks-per-node=1 --kill-on-bad-exit=1 \\",
        "  /shared/ladle/.venv/bin/python -m ladle.cli.main launch /shared/runs/r/spec.json --main-address "
        '"$main_address" --main-port "$main_port" \\',
        '  --stopped-file "$stopped" || code=$?',
        # a node that checkpointed when told to stop exits 0 and says so in a file (a 75 would have srun kill the
        # other nodes as they wind down); the script requeues on either
        'stopped=/shared/logs/"stopped-$SLURM_JOB_ID"',
        "main_port=$((15000 + SLURM_JOB_ID % 10000))",
        # told to stop: a warning SIGUSR1 the grace before the time limit, requeueable, the log appended to
        "#SBATCH --signal=USR1@120",
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        'if [ "$code" -eq 75 ] || { [ "$code" -eq 0 ] && [ -e "$stopped" ]; }; then',
        '  scontrol requeue "$SLURM_JOB_ID"',
    ):
        assert line in script.splitlines(), line
    # The setup lines run before the launch, in order.
    assert script.index("module load") < script.index("source /shared") < script.index("srun ")
    bash = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True, check=False)
    assert bash.returncode == 0, bash.stderr


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"time_limit": "4 hours"}, 'compute.slurm.time_limit = "4 hours": use minutes, MM:SS, HH:MM:SS'),
        (
            {"sbatch_args": ["exclusive"]},
            "compute.slurm.sbatch_args = [\"exclusive\"]: 'exclusive' is not one sbatch option",
        ),
        ({"gpus_per_node": -1}, "compute.slurm.gpus_per_node = -1: Input should be greater than or equal to 0"),
    ],
)
def test_bad_slurm_settings_name_the_field(overrides, message):
    with pytest.raises(ConfigError) as err:
        cfg_with(compute={"target": "slurm", "slurm": overrides})
    assert message in str(err.value)


def test_plan_refuses_what_the_target_cannot_run(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no Slurm client here
    cfg = cfg_with(output="s3://bucket/runs", parallelism={"nodes": 2}, compute={"target": "slurm"})
    with pytest.raises(ConfigError) as err:
        make_plan(cfg, probe(env={}, query_output=""))
    text = str(err.value)
    assert "compute.target = 'slurm': sbatch, srun, scontrol, scancel not found on PATH" in text
    assert "compute.slurm.log_dir = null: output 's3://bucket/runs' is not a local folder" in text


def launch_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run(
        [sys.executable, "-m", "ladle.cli.main", "launch", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture(scope="module")
def specs(tmp_path_factory, slurm_client):  # planning the Slurm target checks that its client is installed
    from tests.helpers import train_spec

    root = tmp_path_factory.mktemp("specs")
    out = {}
    for target in ("local", "slurm"):
        cfg = cfg_with(
            parallelism={"nodes": 2, "main_port": 29500, "cpu_processes": 1},
            compute={"target": target},
            output=str(root),
        )
        spec = train_spec(cfg, root, target)
        path = root / f"{target}.json"
        path.write_text(spec.model_dump_json(), encoding="utf-8")
        out[target] = str(path)
    return out


def test_launch_rank_rules(specs):
    refused = launch_cli(specs["local"], "--node-rank", "0")
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    assert "--node-rank = 0: the run has 2 node(s); node 0 runs the pipeline, so ranks are 1..1." in refused.stderr
    unset = launch_cli(specs["slurm"], env={"SLURM_NODEID": ""})
    assert "--node-rank: not given and $SLURM_NODEID is not set" in unset.stderr
    # Under a scheduler every node runs it, node 0 included, with the scheduler's rank and rendezvous.
    shown = launch_cli(
        specs["slurm"],
        "--main-address",
        "10.1.2.3",
        "--main-port",
        "15042",
        "--print-command",
        env={"SLURM_NODEID": "0"},
    )
    assert shown.returncode == 0, shown.stderr
    assert "--machine_rank 0 --main_process_ip 10.1.2.3 --main_process_port 15042" in " ".join(
        json.loads(shown.stdout.splitlines()[-1])
    )


def test_probing_without_a_reachable_cluster_is_one_clear_line(tmp_path, slurm_client):
    """srun is installed here but no controller answers at the configured address."""
    import os

    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=nowhere\nSlurmctldHost=nohost(127.0.0.1)\nSlurmctldPort=9\nAuthType=auth/none\n")
    done = subprocess.run(
        [sys.executable, "-m", "ladle.cli.main", "plan", "recipes/tiny-cpu.yaml", "--set", "compute.target=slurm"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "SLURM_CONF": str(conf)},
    )
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "compute.target = 'slurm': probing a node with `srun --nodes=1" in done.stderr, done.stderr
    assert "Run the pipeline where Slurm answers" in done.stderr


def test_a_cancel_the_controller_does_not_confirm_says_so_within_its_deadline(tmp_path, monkeypatch):
    """scancel is sent but scontrol hangs (a slurmctld that stopped answering): cancel returns within its
    deadline and says the job's end was not confirmed and how to check, instead of holding the pipeline."""
    import os
    import time

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("scancel", "exit 0"), ("scontrol", "exec sleep 60")):
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    target = compute.get(cfg_with(compute={"target": "slurm"}))
    began = time.monotonic()
    outcome = target.cancel("42", wait_s=2.0)
    assert time.monotonic() - began < 10
    assert outcome.startswith("scancel 42: sent, but not confirmed (scontrol did not answer in 2 s")
    assert outcome.endswith("check it with `squeue -j 42`")
