"""compute.target=slurm on a real two-node Slurm cluster (slurmctld + two slurmd + munge on 127.0.0.1).

- a run trains through `sbatch` on two Slurm nodes (one rank each) and its losses equal the local run's
  (one node, two ranks: the same world size, so the same data order and the same numbers);
- a Prefect flow run stopped the way a worker cancels it (SIGTERM to the flow-run process) cancels its job;
- a job Slurm refuses, a job that fails, and a job stuck in the queue are clear errors naming the setting.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from ladle import compute
from ladle.config import build_config
from ladle.errors import LadleError
from ladle.train.run import TrainingFailed
from tests.helpers import train_spec

pytestmark = pytest.mark.pipeline

BASE = {
    "base": "ladle://tiny-llama",
    "data": {"path": "ladle://demo-alpaca", "seq_len": 128},
    "training": {"max_steps": 4, "micro_batch_size": 2, "checkpoint_every": 2},
}


def slurm_config(tmp_path, max_steps: int = 4, **slurm):
    return build_config(
        {
            **BASE,
            "training": {**BASE["training"], "max_steps": max_steps},
            "output": str(tmp_path),
            "parallelism": {"nodes": 2, "cpu_processes": 1},
            "compute": {"target": "slurm", "slurm": {"poll_interval_s": 0.5, **slurm}},
        },
        [],
    )


# slow: make test proves each part of it: the real cluster's sbatch path and its cancellation
# (test_a_cancelled_flow_run_cancels_its_slurm_job), the batch script's stop, checkpoint and requeue
# (test_the_batch_script_told_to_stop_by_sigterm_waits_for_the_checkpoint_and_requeues), a run told to stop resuming
# as if uninterrupted (tests/train/test_resume.py) and two nodes equal to one (tests/train/test_multinode.py); this
# runs them together on the two-node cluster.
@pytest.mark.slow
def test_training_through_sbatch_on_two_nodes_told_to_stop_resumes_and_equals_the_local_run(slurm_env, tmp_path):
    """Through sbatch on two nodes, and told to stop the way Slurm warns a job before its time limit (SIGUSR1 to
    the job's steps, ``scancel --signal=USR1``): the ranks checkpoint their step, the job requeues itself, resumes
    from that checkpoint and ends with the local uninterrupted run's losses (no step lost)."""
    cfg = slurm_config(tmp_path, max_steps=12)
    target = compute.get(cfg)
    topo = target.probe()  # `ladle probe` ran as a Slurm step on a node
    assert topo.gpu_count == 0 and topo.cpu_count >= 1
    spec = train_spec(cfg, tmp_path, "slurm", topo=topo)
    assert (spec.plan.num_machines, spec.plan.processes_per_machine, spec.plan.world_size) == (2, 1, 2)
    assert "compute target slurm" in " ".join(spec.plan.reasons)

    events, lines, commands = [], [], []

    def progress(event: dict) -> None:
        events.append(event)
        # The cluster says stop (its time limit nears) as soon as training starts: with the relay's half-second
        # look at the log, the signal lands in the first steps on any machine, well before the twelfth.
        if event["event"] == "start" and not any(e["event"] == "start" for e in events[:-1]):
            job = commands[0].split("Slurm job ")[1].split(",")[0]
            subprocess.run(["scancel", "--signal=USR1", job], env=slurm_env.env, check=True, timeout=30)

    result = target.run(spec, on_progress=progress, on_line=lines.append, on_command=commands.append)

    # It went through Slurm: one job over both nodes, rendezvous on the first node's address, requeued once.
    job_id = commands[0].split("Slurm job ")[1].split(",")[0]
    record = slurm_env.scontrol_job(job_id)
    assert (record["JobState"], record["ExitCode"], record["NodeList"], record["NumNodes"]) == (
        "COMPLETED",
        "0:0",
        "n[1-2]",
        "2",
    )
    assert record["Restarts"] == "1", record
    (stopped,) = [e["step"] for e in events if e["event"] == "preempted"]
    assert result.resumed_from_step == stopped and 1 <= stopped < 12
    assert any("went back to the queue" in line for line in lines), lines[-20:]
    assert any(f"job {job_id} on n[1-2], rendezvous 127.0.0.1:" in line for line in lines)
    script = next((tmp_path / "slurm" / "slurm").glob("train-*.sbatch")).read_text()
    assert "#SBATCH --nodes=2" in script and "srun --nodes=2 --ntasks=2 --ntasks-per-node=1" in script
    # Progress was relayed from the job's output as from a local launch, and the result read from the run folder.
    steps = [e["step"] for e in events if e["event"] == "step"]
    assert steps == [*range(1, stopped + 1), *range(stopped + 1, 13)], steps  # each step once: none lost or redone
    assert result.world_size == 2 and result.steps == 12
    assert "#SBATCH --signal=USR1@120" in script and "scontrol requeue" in script

    training = {**BASE["training"], "max_steps": 12}
    local_cfg = build_config(
        {**BASE, "training": training, "output": str(tmp_path), "parallelism": {"cpu_processes": 2}}, []
    )
    local = compute.get(local_cfg).run(train_spec(local_cfg, tmp_path, "local"))
    assert result.train_losses == pytest.approx(local.train_losses, abs=1e-6)
    assert result.eval_loss_after == pytest.approx(local.eval_loss_after, abs=1e-6)


CANCEL_SCRIPT = """
import sys
from pathlib import Path
from prefect import flow
from ladle.config import build_config
from ladle.tasks.train import train_task
from ladle.lifecycle.tracking import start_run
from tests.helpers import train_spec

root = Path(sys.argv[1])
cfg = build_config({
    "base": "ladle://tiny-llama", "data": {"path": "ladle://demo-alpaca", "seq_len": 128}, "output": str(root),
    "training": {"max_steps": 100000, "micro_batch_size": 2},
    "parallelism": {"nodes": 2, "cpu_processes": 1},
    "compute": {"target": "slurm", "slurm": {"poll_interval_s": 0.5}},
}, [])
spec = train_spec(cfg, root, "cancelled")

@flow
def train_only():
    return train_task(cfg, spec.plan, spec.dataset, spec.base_dir, spec.run_url, start_run(cfg, None, "cancel-test"))

train_only()
"""


def queue(env) -> list[str]:
    out = subprocess.run(["squeue", "-h", "-o", "%i %T"], capture_output=True, text=True, env=env, check=True)
    return out.stdout.split()


def test_a_cancelled_flow_run_cancels_its_slurm_job(slurm_env, prefect_harness, tmp_path):
    """A Prefect worker cancels a flow run by sending its process SIGTERM; Prefect raises in the flow, and the
    train stage must take the Slurm job down with it."""
    import os

    script = tmp_path / "cancel.py"
    script.write_text(textwrap.dedent(CANCEL_SCRIPT), encoding="utf-8")
    from prefect.settings import PREFECT_API_URL

    # The harness's API server, so the flow-run process does not start a server of its own.
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "PREFECT_API_URL": PREFECT_API_URL.value()}
    log = tmp_path / "flow.log"  # a file, not a pipe: nobody reads a pipe while the test waits, and it fills
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, str(script), str(tmp_path)], env=env, stdout=out, stderr=out)
    deadline = time.monotonic() + 240
    job_log = None
    while job_log is None and time.monotonic() < deadline:  # training has started inside the job
        logs = list((tmp_path / "cancelled" / "slurm").glob("train-*.out"))
        if logs and "step" in logs[0].read_text(errors="replace"):
            job_log = logs[0]
        assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
        time.sleep(0.5)
    assert job_log is not None, "the job never started training"
    job_id = job_log.stem.removeprefix("train-")
    assert slurm_env.scontrol_job(job_id)["JobState"] == "RUNNING"

    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    out = log.read_text(errors="replace")
    assert proc.returncode != 0
    assert f"scancel {job_id}" in out
    assert slurm_env.scontrol_job(job_id)["JobState"] == "CANCELLED"
    deadline = time.monotonic() + 60
    while job_id in queue(slurm_env.env) and time.monotonic() < deadline:  # its steps are being torn down
        time.sleep(0.5)
    assert job_id not in queue(slurm_env.env)


def test_a_refused_job_names_the_setting(slurm_env, tmp_path):
    cfg = slurm_config(tmp_path, partition="nosuch")
    spec = train_spec(cfg, tmp_path, "refused")
    with pytest.raises(LadleError, match=r"(?i)invalid partition.*Check compute\.slurm\.partition"):
        compute.get(cfg).run(spec)


def test_a_failing_job_reports_slurms_state_and_the_output(slurm_env, tmp_path):
    cfg = slurm_config(tmp_path, setup=["echo 'no GPU driver on this node' >&2", "exit 3"])
    spec = train_spec(cfg, tmp_path, "failing")
    with pytest.raises(TrainingFailed, match=r"(?s)ended FAILED \(exit code 3:0.*no GPU driver on this node"):
        compute.get(cfg).run(spec)


def test_a_job_stuck_in_the_queue_is_cancelled_after_pending_timeout(slurm_env, tmp_path):
    cfg = slurm_config(tmp_path, pending_timeout_s=2, sbatch_args=["--begin=now+1hour"])
    spec = train_spec(cfg, tmp_path, "stuck")
    with pytest.raises(
        LadleError, match=r"compute\.slurm\.pending_timeout_s = 2: job (\d+) waited \d+ s in the queue \(BeginTime\)"
    ) as err:
        compute.get(cfg).run(spec)
    job_id = err.value.args[0].split("job ")[1].split(" ")[0]
    assert slurm_env.scontrol_job(job_id)["JobState"] == "CANCELLED"


def test_an_unreadable_job_state_is_looked_at_again_then_the_job_is_cancelled(slurm_env, tmp_path, monkeypatch):
    """scontrol failing (a controller restarting) is not the job's end: looked at again, and past
    ``UNKNOWN_S`` the job is cancelled before the task's retry could start a second one beside it."""
    import os

    from ladle.compute import slurm

    real = subprocess.run(["which", "scontrol"], capture_output=True, text=True, check=True).stdout.strip()
    wrapper = tmp_path / "bin" / "scontrol"
    wrapper.parent.mkdir()
    wrapper.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = show ] && [ "$2" = job ]; then\n'
        "  echo 'slurm_load_jobs error: Socket timed out on send/recv operation' >&2; exit 1\n"
        "fi\n"
        f'exec {real} "$@"\n'
    )
    wrapper.chmod(0o755)
    monkeypatch.setenv("PATH", f"{wrapper.parent}:{os.environ['PATH']}")
    monkeypatch.setattr(slurm, "UNKNOWN_S", 2.0)
    cfg = slurm_config(tmp_path, sbatch_args=["--begin=now+1hour"])
    spec = train_spec(cfg, tmp_path, "unreadable")
    with pytest.raises(
        LadleError, match=r"Slurm job (\d+): its state could not be read for 2 s \(slurm_load_jobs"
    ) as err:
        compute.get(cfg).run(spec)
    job_id = err.value.args[0].split("job ")[1].split(":")[0]
    monkeypatch.setenv("PATH", os.environ["PATH"].split(":", 1)[1])
    assert slurm_env.scontrol_job(job_id)["JobState"] == "CANCELLED"


def test_a_state_that_comes_back_is_followed_to_the_end(tmp_path, monkeypatch):
    """Two failed looks, then the job's real states: the follow goes on to COMPLETED."""
    from ladle.compute import slurm

    looks = iter(
        [
            {"JobState": "RUNNING"},
            {"JobState": "UNKNOWN", "Reason": "Socket timed out", "Gone": ""},
            LadleError("scontrol did not answer in 60 s"),
            {"JobState": "RUNNING"},
            {"JobState": "COMPLETED", "ExitCode": "0:0"},
        ]
    )

    def job(self, job_id, timeout=60):
        look = next(looks)
        if isinstance(look, Exception):
            raise look
        return look

    monkeypatch.setattr(slurm.SlurmTarget, "job", job)
    target = slurm.SlurmTarget(slurm_config(tmp_path, poll_interval_s=0.1))
    relay = type("Relay", (), {"feed": lambda self, text: None, "on_line": None})()
    assert target.follow("7", tmp_path / "none.out", relay)["JobState"] == "COMPLETED"


@pytest.mark.parametrize("state", ["RUNNING", "COMPLETING"])
def test_the_batch_script_told_to_stop_by_sigterm_waits_for_the_checkpoint_and_requeues(tmp_path, state):
    """A preemption's SIGTERM reaches the batch shell as well as the ranks: the script waits for its step (whose
    ranks checkpoint, exit 0 and leave the stopped file) and requeues the job. Without its trap the shell died at
    the signal and the requeue never ran. A job a user cancelled (scancel: SIGTERM too, the job CANCELLED) keeps its
    checkpoint and is not requeued. ``srun`` and ``scontrol`` are stand-ins on PATH: the script's own handling of
    the signal runs for real in bash (the two-node tests stop and cancel jobs through Slurm itself)."""
    from types import SimpleNamespace

    from ladle.compute import slurm

    bin_dir, log, began = tmp_path / "bin", tmp_path / "calls", tmp_path / "step-began"
    bin_dir.mkdir()
    stand_ins = {  # srun: the ranks, which checkpoint on SIGTERM and leave the file `ladle launch` writes
        "srun": f'stopped="${{@: -1}}"\ntrap \'touch "$stopped"; exit 0\' TERM\ntouch {began}\n'
        "sleep 60 & wait $!\nexit 1\n",
        "scontrol": f'echo "scontrol $*" >> {log}\n[ "$1" = show ] && [ "$2" = hostnames ] && echo n1\n'
        f'[ "$1" = show ] && [ "$2" = job ] && echo "JobId=41 JobState={state} Reason=None"\nexit 0\n',
    }
    for name, body in stand_ins.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + body)
        (bin_dir / name).chmod(0o755)
    target = slurm.SlurmTarget(slurm_config(tmp_path))
    plan = SimpleNamespace(num_machines=2, device="cpu", processes_per_machine=1)
    script = tmp_path / "train.sbatch"
    script.write_text(target.script("file:///spec.json", plan, tmp_path / "train-%j.out"))
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": "41", "SLURM_JOB_NODELIST": "n[1-2]"}
    shell = subprocess.Popen(
        ["bash", str(script)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60  # a busy machine starts processes slowly
        while not began.exists():  # the step's trap is set: the signal finds both ready
            assert shell.poll() is None, f"the script ended before its step: {shell.communicate()[0]}"
            assert time.monotonic() < deadline, "the script never started its step"
            time.sleep(0.05)
        os.killpg(shell.pid, signal.SIGTERM)  # what Slurm does on preemption: the shell and its step
        out, _ = shell.communicate(timeout=60)
    finally:
        if shell.poll() is None:
            os.killpg(shell.pid, signal.SIGKILL)
            shell.wait()
    assert shell.returncode == 0, out
    assert "told to stop (SIGTERM); waiting for its ranks to checkpoint" in out
    if state == "RUNNING":
        assert "checkpointed when told to stop (JobState=RUNNING); requeueing it" in out
        assert "scontrol requeue 41" in log.read_text()
    else:
        assert "was cancelled; its checkpoint is kept, the job is not requeued" in out
        assert "requeue" not in log.read_text()
