"""``compute.target: slurm``: one ``sbatch`` job over the plan's nodes, followed until it ends.

The batch script asks for ``parallelism.nodes`` nodes with one task each; ``srun`` starts ``ladle launch`` on
every node, which starts that node's ranks with the plan's launch. The rendezvous (a c10d TCP store) is on the allocation's first node, at its ``NodeAddr``, on ``parallelism.main_port`` or
else a port derived from the job id (two jobs sharing a node do not collide). Each node's rank is its
``SLURM_NODEID``, so global rank 0 (which logs and writes the result) is on the first node.

The pipeline follows the job with ``scontrol`` and reads its output file as it grows: the worker's progress
events reach the Prefect log and MLflow exactly as from a local launch, and the result is read from the run
folder in the artifact store. A failed job becomes a ``TrainingFailed`` naming Slurm's state and reason (the
train task's retry submits a new job that resumes from the last checkpoint); an interrupted pipeline (a
Prefect cancel raises in the flow-run process) cancels the job with ``scancel``.
"""

from __future__ import annotations

import json
import math
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ladle.compute.base import ComputeTarget
from ladle.errors import LadleError
from ladle.platform import storage
from ladle.train.preempt import PREEMPTED

UNKNOWN_S = 120.0
"""Seconds a job's state may stay unreadable (a controller restarting, a transient RPC failure) before the follow
gives up and cancels it."""
RUNNING = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING", "SIGNALING"}
# Pending reasons that waiting does not cure: the request itself is beyond what the partition or account allows.
HOPELESS = {
    "PartitionNodeLimit": "parallelism.nodes is above the partition's node limit",
    "PartitionTimeLimit": "compute.slurm.time_limit is above the partition's time limit",
    "BadConstraints": "the job's constraints (compute.slurm.sbatch_args) match no node",
    "AccountNotAllowed": "compute.slurm.account may not use this partition",
    "QOSNotAllowed": "compute.slurm.qos may not use this partition",
    "InvalidAccount": "compute.slurm.account is not a valid account",
    "InvalidQOS": "compute.slurm.qos is not a valid QOS",
}
# What sbatch says when it refuses a job, and the setting that causes it.
REFUSALS = (
    ("invalid partition", "compute.slurm.partition"),
    ("invalid account", "compute.slurm.account"),
    ("invalid qos", "compute.slurm.qos"),
    ("time limit", "compute.slurm.time_limit"),
    ("gres", "compute.slurm.gpus_per_node"),
    ("node count", "parallelism.nodes"),
    ("node configuration is not available", "parallelism.nodes / compute.slurm.gpus_per_node / cpus_per_task"),
    ("more processors than", "compute.slurm.cpus_per_task"),
)
FAILURES = {
    "TIMEOUT": "reached compute.slurm.time_limit = {time}; raise it (the train task's retry resumes from the "
    "last checkpoint)",
    "NODE_FAIL": "a node failed ({nodes}); the train task's retry resumes from the last checkpoint",
    "OUT_OF_MEMORY": "a node ran out of host memory ({nodes}); lower training.micro_batch_size or ask for more "
    "with compute.slurm.sbatch_args=['--mem=...']",
    "CANCELLED": "it was cancelled outside ladle (scancel or an administrator)",
    "PREEMPTED": "it was preempted; the train task's retry resumes from the last checkpoint",
    "BOOT_FAIL": "its nodes failed to boot ({nodes})",
    "DEADLINE": "it reached its deadline",
}


def call(argv: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    """Run a Slurm client command; a missing command or a hung controller is a clear error."""
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except FileNotFoundError:
        raise LadleError(f"compute.target = 'slurm': {argv[0]} not found on PATH. Run on a Slurm login node.") from None
    except subprocess.TimeoutExpired:
        raise LadleError(f"{argv[0]} did not answer in {timeout:.0f} s: is slurmctld up? (`scontrol ping`)") from None


def parse_fields(text: str) -> dict[str, str]:
    """``Key=Value`` pairs of ``scontrol show ... -o`` output (one record on one line)."""
    return dict(re.findall(r"(\w+)=(\S*)", text))


def node_address_script(nodes_var: str = "SLURM_JOB_NODELIST") -> list[str]:
    """Shell lines that set ``main_address`` to the first allocated node's address (its ``NodeAddr``, which
    may differ from its name)."""
    return [
        f'head_node=$(scontrol show hostnames "${nodes_var}" | head -n 1)',
        "main_address=$(scontrol show node \"$head_node\" -o | sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p')",
        "main_address=${main_address:-$head_node}",
    ]


class LogFollower:
    """Reads a growing output file line by line; a partial last line waits for its end."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.partial = path, 0, ""

    def pump(self, feed, final: bool = False) -> None:
        if not self.path.exists():
            return
        with self.path.open("r", encoding="utf-8", errors="replace") as handle:
            handle.seek(self.offset)
            text = handle.read()
            self.offset = handle.tell()
        lines = (self.partial + text).split("\n")
        self.partial = lines.pop()
        if final and self.partial:
            lines.append(self.partial)
            self.partial = ""
        for line in lines:
            feed(line)


class SlurmTarget(ComputeTarget):
    name = "slurm"
    summary = "one `sbatch` job over parallelism.nodes nodes, followed until it ends"

    def python(self) -> str:
        return self.opts.python or sys.executable

    def placement(self, nodes: int, gpus: int, time_limit: str) -> list[str]:
        """The sbatch/srun options every request carries: size, queue, account, limits."""
        o = self.opts
        args = [f"--nodes={nodes}", "--ntasks-per-node=1", f"--time={time_limit}"]
        args += [f"--{name}={value}" for name, value in (("partition", o.partition), ("account", o.account)) if value]
        args += [f"--qos={o.qos}"] if o.qos else []
        args += [f"--gres=gpu:{gpus}"] if gpus else []
        args += [f"--cpus-per-task={o.cpus_per_task}"] if o.cpus_per_task else []
        return args

    def script(self, spec_url: str, plan, log_file: Path) -> str:
        """The batch script for ``plan``: one ``ladle launch`` per node."""
        nodes = plan.num_machines
        grace = math.ceil(self.cfg.training.preempt_grace_s)
        directives = [
            f"--job-name=ladle-{self.cfg.name}",
            *self.placement(nodes, self.gpus_per_node(plan), self.opts.time_limit),
            f"--output={log_file}",
            "--open-mode=append",  # a requeued job's output goes on after the first run's
            "--requeue",
            f"--signal=USR1@{grace}",  # before the time limit: checkpoint and requeue (ladle.train.preempt)
            *self.opts.sbatch_args,
        ]
        port = (
            str(self.cfg.parallelism.main_port)
            if self.cfg.parallelism.main_port
            else "$((15000 + SLURM_JOB_ID % 10000))"
        )
        launch = [self.python(), "-m", "ladle.cli.main", "launch", spec_url]
        return "\n".join(
            [
                "#!/bin/bash",
                *[f"#SBATCH {shlex.quote(d)}" for d in directives],
                "# Rendered by ladle from the run's plan: one task per node, each running `ladle launch`, which",
                "# starts the node's ranks; node ranks are SLURM_NODEID, the rendezvous is on the first node.",
                "set -euo pipefail",
                *self.opts.setup,
                *node_address_script(),
                f"main_port={port}",
                'echo "ladle: job $SLURM_JOB_ID on $SLURM_JOB_NODELIST, rendezvous $main_address:$main_port"',
                "# A node whose ranks were told to stop (SIGUSR1 before the time limit, SIGTERM on preemption) and",
                "# checkpointed their step exits 0 and writes this file: a 75 would make srun kill the other nodes",
                "# while they wind down. The job then goes back to the queue and resumes from that checkpoint.",
                f'stopped={shlex.quote(str(Path(log_file).parent))}/"stopped-$SLURM_JOB_ID"',
                'rm -f "$stopped"',
                "# SIGTERM (a preemption, scancel) reaches this shell too. Its default would end the script at once,",
                "# before the ranks have checkpointed and before the requeue below: note it and wait for srun.",
                'told=""',
                "trap 'told=TERM; echo \"ladle: job $SLURM_JOB_ID told to stop (SIGTERM); waiting for its ranks to "
                "checkpoint\"' TERM",
                "code=0",
                f"srun --nodes={nodes} --ntasks={nodes} --ntasks-per-node=1 --kill-on-bad-exit=1 \\",
                f'  {shlex.join(launch)} --main-address "$main_address" --main-port "$main_port" \\',
                '  --stopped-file "$stopped" || code=$?',
                f'if [ "$code" -eq {PREEMPTED} ] || {{ [ "$code" -eq 0 ] && [ -e "$stopped" ]; }}; then',
                '  rm -f "$stopped"',
                "  # A user's scancel also sends SIGTERM, and the job is then ending (COMPLETING, CANCELLED) where a",
                "  # preemption's or a time limit's job is still RUNNING: a cancelled job keeps its checkpoint, stays off.",
                '  state=$(scontrol show job "$SLURM_JOB_ID" -o 2>&1 | grep -o "JobState=[A-Z_]*" || true)',
                '  if [ "$told" = TERM ] && { [ "$state" = JobState=CANCELLED ] || [ "$state" = JobState=COMPLETING ]; }; then',
                '    echo "ladle: job $SLURM_JOB_ID was cancelled; its checkpoint is kept, the job is not requeued"',
                "    exit 0",
                "  fi",
                '  echo "ladle: job $SLURM_JOB_ID checkpointed when told to stop ($state); requeueing it"',
                '  scontrol requeue "$SLURM_JOB_ID"',
                "  exit 0",
                "fi",
                'exit "$code"',
                "",
            ]
        )

    def launch_text(self, plan, spec: str) -> str:
        return "sbatch script:\n" + self.script(spec, plan, Path("LOG_DIR/train-%j.out"))

    def log_dir(self, run_url: str) -> Path:
        folder = Path(self.opts.log_dir) if self.opts.log_dir else storage.local_path(run_url) / "slurm"
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def submit(self, script: Path) -> str:
        """``sbatch --parsable``; returns the job id. A refused job is a ``LadleError`` naming the setting."""
        done = call(["sbatch", "--parsable", str(script)])
        if done.returncode != 0:
            message = (done.stderr or done.stdout).strip().replace("sbatch: error: ", "")
            field = next((f for key, f in REFUSALS if key in message.lower()), None)
            fix = f" Check {field}." if field else ""
            raise LadleError(f"Slurm refused the training job ({script}): {message}.{fix}")
        return done.stdout.strip().split(";")[0]

    def job(self, job_id: str, timeout: float = 60) -> dict[str, str]:
        """The job's record (``JobState``, ``Reason``, ``ExitCode``, ``NodeList``...); each command given
        ``timeout`` seconds."""
        done = call(["scontrol", "show", "job", "-o", job_id], timeout=timeout)
        if done.returncode == 0 and "JobState=" in done.stdout:
            return parse_fields(done.stdout)
        # Gone from the controller's memory (MinJobAge passed): accounting, where there is one.
        if shutil.which("sacct"):
            acct = call(["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "State,ExitCode,Reason,NodeList"], timeout)
            row = acct.stdout.strip().splitlines()[:1]
            if acct.returncode == 0 and row:
                state, code, reason, nodes = (row[0].split("|") + ["", "", "", ""])[:4]
                return {"JobState": state.split()[0], "ExitCode": code, "Reason": reason, "NodeList": nodes}
        said = (done.stderr or done.stdout).strip()
        # "Invalid job id": the controller answered, and no longer knows the job. Anything else is a failed look.
        return {"JobState": "UNKNOWN", "Reason": said, "Gone": "1" if "invalid job id" in said.lower() else ""}

    def cancel(self, job_id: str, wait_s: float = 30.0) -> str:
        """``scancel``, then wait until the job has left the running states: all of it within ``wait_s``, every
        command included (a slurmctld slow to answer on a loaded machine once held a cancelled flow run for
        minutes, each ``scontrol`` given its own 60 s).

        Returns:
            what happened, for the run's log: the job's state once it left the running ones, or why that could
            not be confirmed (the controller did not answer in time, or the job was still running), with the
            command to check it by hand. The pipeline is stopping either way; it is not held longer.
        """
        deadline = time.monotonic() + wait_s
        state = "not known"
        try:
            call(["scancel", job_id], timeout=wait_s / 2)
            while (left := deadline - time.monotonic()) > 0:
                state = self.job(job_id, timeout=max(1.0, left)).get("JobState", "UNKNOWN")
                if state not in RUNNING - {"PENDING"}:
                    return f"scancel {job_id}: the pipeline stopped, so its job was cancelled (now {state})"
                time.sleep(0.5)
            why = f"still {state} after {wait_s:g} s"
        except LadleError as err:  # scancel or scontrol did not answer within the deadline
            why = str(err)
        return f"scancel {job_id}: sent, but not confirmed ({why}); check it with `squeue -j {job_id}`"

    def follow(self, job_id: str, log: Path, relay, finished=lambda: False) -> dict[str, str]:
        """Relay the job's output until it ends; returns its final record. A state that cannot be read is
        looked at again, never taken for an end: within ``UNKNOWN_S`` it is known again, or the follow fails (and
        the caller cancels the job before any retry, so no second job writes the same checkpoints beside it).
        ``finished``: whether the job's result is written, for a job the controller has already forgotten."""
        follower, last_reason, start = LogFollower(log), None, time.monotonic()
        unknown_since: float | None = None
        seen_running = False
        while True:
            try:
                info = self.job(job_id)
            except LadleError as err:  # the controller did not answer this look
                info = {"JobState": "UNKNOWN", "Reason": str(err)}
            follower.pump(relay.feed)
            state, reason = info.get("JobState", "UNKNOWN"), info.get("Reason", "")
            if state == "UNKNOWN":
                if info.get("Gone") and finished():
                    follower.pump(relay.feed, final=True)
                    return {**info, "JobState": "COMPLETED", "ExitCode": "0:0"}
                unknown_since = unknown_since or time.monotonic()
                if time.monotonic() - unknown_since > UNKNOWN_S:
                    raise LadleError(
                        f"Slurm job {job_id}: its state could not be read for {UNKNOWN_S:g} s ({reason[:200]}); it is "
                        "cancelled so that no retry runs beside it. Check the controller (`scontrol ping`)."
                    )
                time.sleep(self.opts.poll_interval_s)
                continue
            unknown_since = None
            if state in ("REQUEUED", "PENDING") and seen_running:  # it checkpointed when told to stop, or was preempted
                seen_running, start, last_reason = False, time.monotonic(), None
                if relay.on_line:
                    relay.on_line(
                        f"slurm: job {job_id} went back to the queue ({state}); it resumes from its checkpoint"
                    )
            if state in ("RUNNING", "COMPLETING"):
                seen_running = True
            if state == "PENDING":
                if reason != last_reason and reason not in ("", "None") and relay.on_line:
                    relay.on_line(f"slurm: job {job_id} pending ({reason})")
                last_reason = reason
                if reason in HOPELESS:
                    raise LadleError(f"Slurm job {job_id} can never start: {HOPELESS[reason]} (reason {reason}).")
                waited = time.monotonic() - start
                if self.opts.pending_timeout_s and waited > self.opts.pending_timeout_s:
                    raise LadleError(
                        f"compute.slurm.pending_timeout_s = {self.opts.pending_timeout_s:g}: job {job_id} waited "
                        f"{waited:.0f} s in the queue ({reason}). Raise it (0: wait as long as it takes), or ask for "
                        "fewer nodes or another partition."
                    )
            elif state not in RUNNING:
                follower.pump(relay.feed, final=True)
                return info
            time.sleep(self.opts.poll_interval_s)

    def probe(self):
        """``ladle probe`` on one node of the cluster, with the GPUs training will ask for."""
        from ladle.machine.topology import Topology

        argv = ["srun", *self.placement(1, self.gpus_per_node(), "5"), "--job-name=ladle-probe"]
        done = call([*argv, self.python(), "-m", "ladle.cli.main", "probe", "--json"], timeout=600)
        lines = done.stdout.strip().splitlines()
        if done.returncode != 0 or not lines:
            said = (done.stderr or done.stdout).strip().splitlines() or ["no output"]
            raise LadleError(
                f"compute.target = 'slurm': probing a node with `{shlex.join(argv)}` failed: {said[-1]}. Run the "
                "pipeline where Slurm answers (`sinfo` works there; $SLURM_CONF names the cluster's slurm.conf), "
                "and check compute.slurm.partition/account."
            )
        topo = Topology.model_validate(json.loads(lines[-1]))
        if topo.gpu_count == 0 and self.opts.gpus_per_node is None and self.cfg.parallelism.gpus == "auto":
            topo.warnings.append(
                "compute.slurm.gpus_per_node is unset and parallelism.gpus is auto, so the probe asked Slurm for no "
                "GPUs and the plan is a CPU run: set compute.slurm.gpus_per_node to train on the nodes' GPUs"
            )
        return topo

    def run(self, spec, on_progress=None, on_line=None, on_command=None):
        from ladle import strategies
        from ladle.train.run import Relay, read_result, write_spec

        strategies.get(spec.plan.strategy).before_launch(spec.plan)
        relay = Relay(on_progress, on_line)
        with tempfile.TemporaryDirectory(prefix="ladle-slurm-") as tmp:
            spec_file = write_spec(spec, tmp)
            spec_url = str(spec_file) if storage.is_local(spec.run_url) else storage.join(spec.run_url, "spec.json")
            folder = self.log_dir(spec.run_url)
            script = folder / f"train-{time.strftime('%Y%m%d-%H%M%S')}.sbatch"
            script.write_text(self.script(spec_url, spec.plan, folder / "train-%j.out"), encoding="utf-8")
            job_id = self.submit(script)
            if on_command:
                on_command(f"sbatch {script}: Slurm job {job_id}, {spec.plan.num_machines} node(s)")
            try:
                done = lambda: storage.exists(storage.join(spec.run_url, "train_result.json"))  # noqa: E731
                info = self.follow(job_id, folder / f"train-{job_id}.out", relay, finished=done)
            except BaseException:
                outcome = self.cancel(job_id)
                if on_command:
                    on_command(outcome)
                raise
        state, code = info.get("JobState"), info.get("ExitCode", "")
        if state == "COMPLETED" and code in ("0:0", ""):
            return read_result(spec)
        why = FAILURES.get(state, "").format(time=self.opts.time_limit, nodes=info.get("NodeList", "?"))
        what = f"Slurm job {job_id} ended {state} (exit code {code}, reason {info.get('Reason', '?')})"
        raise relay.failure(f"{what}{': ' + why if why else ''}")
