"""Train stage: launch the worker's ranks (``accelerate launch`` on GPUs, ``ladle.train.launch`` on CPUs: the
plan's ``launcher_argv``) and relay their progress."""

from __future__ import annotations

import collections
import contextlib
import json
import math
import shlex
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

from ladle.machine import cuda_arch
from ladle.machine.topology import usable_cores
from ladle.platform import secrets, storage
from ladle.platform.processes import free_port, stop_process  # noqa: F401 - free_port is also imported from here
from ladle.train.preempt import PREEMPTED, STOPPED
from ladle.train.spec import PROGRESS_PREFIX, TrainResult, TrainSpec

ProgressFn = Callable[[dict], None]


class TrainingFailed(RuntimeError):
    """The training processes exited non-zero; the message carries the tail of their output."""


def worker_env(spec: TrainSpec) -> dict[str, str]:
    """The launch environment: the user's settings win over ladle's hints (but for an arch list DeepSpeed
    cannot parse, rewritten to the same capabilities: ``ladle.machine.cuda_arch``)."""
    env, _ = cuda_arch.fixed_env()
    if spec.plan.device == "cpu":
        # Each rank gets its share of the cores instead of all of them (oversubscription halves throughput).
        cores = usable_cores(env)
        env.setdefault("OMP_NUM_THREADS", str(max(1, cores // spec.plan.processes_per_machine)))
        env.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed would otherwise guess, and say so on stdout
    if spec.plan.device == "cuda":
        # Hints only: a setting the user exported wins. Peer-to-peer is never forced on (NCCL_P2P_*
        # stay NCCL's own choice): cards without P2P support hang or corrupt when it is.
        env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # a failed collective raises instead of hanging
        env.setdefault("NCCL_DEBUG", "WARN")
        if spec.plan.num_machines > 1:
            env.setdefault("NCCL_SOCKET_IFNAME", "^lo,docker")  # not loopback or container bridges across machines
    # this run's tracking server's credentials, kept by the launching process for that server alone
    env.update(secrets.credential_env(spec.tracking_uri))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("PYTHONUNBUFFERED", "1")
    config = getattr(spec, "config", None)  # (a spec stand-in for the environment alone has none)
    if config is not None:
        env["LADLE_PREEMPT_GRACE_S"] = str(config.training.preempt_grace_s)  # the launchers' wait (preempt)
        # torchrun's agent (under accelerate launch) gives its workers 30 s between its SIGTERM and a SIGKILL:
        # ranks still writing their checkpoint past that were killed, whatever preempt_grace_s said. torch reads
        # this variable where --shutdown-timeout is not given (pytorch#172596, torch >= 2.11; an older one ignores it).
        env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = str(math.ceil(config.training.preempt_grace_s))
    # glibc raises its mmap threshold to the size of each large block freed (up to 32 MB), after which the
    # one-tensor-at-a-time loading's blocks come from the heap and stay there when freed: measured, a ZeRO-3
    # rank of a 1.5 GB model kept +500 MB after loading. A fixed 4 MiB threshold returns large blocks to the
    # system when freed (smaller ones, most of a step's allocations, still use the heap).
    env.setdefault("MALLOC_MMAP_THRESHOLD_", str(4 * 2**20))
    return env


def spec_location(spec: TrainSpec, tmp: str) -> Path:
    """Where the worker reads its spec: the run folder when it is local (so the logged
    command can be re-run as is), else a temporary file."""
    if storage.is_local(spec.run_url):
        return storage.local_path(spec.run_url) / "spec.json"
    return Path(tmp) / "spec.json"


def join_command(spec: TrainSpec, node_rank: int) -> str:
    """What another machine runs to join this training run."""
    return shlex.join(["ladle", "launch", storage.join(spec.run_url, "spec.json"), "--node-rank", str(node_rank)])


def echo(line: str) -> None:
    """Print a line now: under a scheduler stdout is a file, and the pipeline follows it while the job runs."""
    print(line, flush=True)


def run_node(
    spec_url: str,
    node_rank: int,
    on_line: Callable[[str], None] = echo,
    main_address: str | None = None,
    main_port: int | None = None,
) -> int:
    """Start this machine's share of a multi-node run from its spec; returns the launcher's exit code.

    ``main_address``/``main_port`` replace the plan's rendezvous when a scheduler (Slurm, Kubernetes) chose
    the machines after planning: node 0 is then the allocation's first node.
    """
    spec = TrainSpec.model_validate_json(storage.read_bytes(spec_url))
    with tempfile.TemporaryDirectory(prefix="ladle-node-") as tmp:
        spec_file = Path(tmp) / "spec.json"
        spec_file.write_text(spec.model_dump_json(), encoding="utf-8")
        argv = spec.plan.launcher_argv(
            [str(spec_file)], machine_rank=node_rank, main_address=main_address, main_port=main_port
        )
        import signal

        # Slurm signals every process of a job step, the launcher's too: torchrun would die of SIGUSR1 (its
        # default action), so the launcher starts with it ignored (the ranks install their own handler).
        previous = signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        try:
            proc = subprocess.Popen(
                argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=worker_env(spec)
            )
        finally:
            signal.signal(signal.SIGUSR1, previous)
        assert proc.stdout is not None
        forward_stops(proc, spec)
        checkpointed = False
        try:
            for line in proc.stdout:
                line = line.rstrip("\n")
                on_line(line)  # every line as it came: the pipeline follows this output and reads its events
                checkpointed = checkpointed or STOPPED in line
            code = proc.wait()
        except BaseException:  # interrupted, or the launcher did not end within the grace
            stop_process(proc, grace_s=10)
            raise
        # The ranks checkpointed when told to stop; torchrun reports their exit as a failure of its own code.
        return PREEMPTED if code != 0 and checkpointed else code


def forward_stops(proc: subprocess.Popen, spec: TrainSpec) -> None:
    """The scheduler's stop (SIGTERM; SIGUSR1 from Slurm's ``--signal``) passed to the node's launcher, whose ranks
    checkpoint their step and exit ``PREEMPTED`` (``ladle.train.preempt``); this process keeps relaying their
    output until they end. ladle's CPU launcher passes either signal on; ``accelerate launch`` (torchrun) stops its
    workers with SIGTERM on SIGTERM and dies of SIGUSR1, so it is given SIGTERM."""
    import signal

    cpu = "ladle.train.launch" in " ".join(proc.args)

    def forward(signum, _frame):
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signum if cpu else signal.SIGTERM)

    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, forward)


def progress_events(line: str) -> list[dict]:
    """The worker events on an output line; none when it is ordinary output.

    Several ranks share one pipe. The worker writes each event line in one
    atomic write, but other output (a library's print) can still land on the
    same line; a line that does not parse is kept as output, never fatal.
    """
    start = line.find(PROGRESS_PREFIX)
    if start < 0:
        return []
    decoder, events = json.JSONDecoder(), []
    rest = line[start:]
    while rest.startswith(PROGRESS_PREFIX):
        try:
            event, end = decoder.raw_decode(rest, len(PROGRESS_PREFIX))
        except json.JSONDecodeError:
            return events
        events.append(event)
        rest = rest[end:].lstrip()
        rest = rest[rest.find(PROGRESS_PREFIX) :] if PROGRESS_PREFIX in rest else ""
    return events


class Relay:
    """What the pipeline does with the training processes' output, wherever it comes from (a local pipe, a
    Slurm job's log): worker events go to ``on_progress``, other lines to ``on_line``, and the last lines and
    the first reported error are kept for the failure message."""

    def __init__(self, on_progress: ProgressFn | None = None, on_line: Callable[[str], None] | None = None) -> None:
        self.on_progress, self.on_line = on_progress, on_line
        self.tail: collections.deque[str] = collections.deque(maxlen=40)
        self.errors: list[dict] = []
        self.preempted: list[int] = []  # the steps the run checkpointed when told to stop

    def feed(self, line: str) -> None:
        line = line.rstrip("\n")
        events = progress_events(line)
        for event in events:
            if event.get("event") == "error":
                self.errors.append(event)
                continue
            if event.get("event") == "preempted":
                self.preempted.append(event["step"])
            if self.on_progress:
                self.on_progress(event)
        if events:
            return
        self.tail.append(line)
        if self.on_line:
            self.on_line(line)

    def failure(self, what: str) -> TrainingFailed:
        """``what`` (e.g. "training exited with code 1"), the first rank's reported error, the last output lines, and
        that error again as the last line."""
        if not self.errors:
            return TrainingFailed(f"{what}; last output:\n" + "\n".join(self.tail))
        # The cause is the first line and the last: the launcher's own "rank N exited" lines end the output, and a
        # user reads the last line first.
        cause = f"rank {self.errors[0]['rank']}: {self.errors[0]['error']}"
        return TrainingFailed(f"{what}; {cause}\nlast output:\n" + "\n".join(self.tail) + f"\n{cause}")


def read_result(spec: TrainSpec) -> TrainResult:
    """The result rank 0 wrote to the artifact store."""
    return TrainResult.model_validate(storage.read_json(storage.join(spec.run_url, "train_result.json")))


def write_spec(spec: TrainSpec, tmp: str) -> Path:
    """Write the spec where the worker reads it (and to the store when the run folder is remote, so other
    nodes read it there); returns the local file."""
    spec_file = spec_location(spec, tmp)
    spec_file.parent.mkdir(parents=True, exist_ok=True)
    spec_file.write_text(spec.model_dump_json(indent=1), encoding="utf-8")
    if not storage.is_local(spec.run_url):
        storage.write_bytes(storage.join(spec.run_url, "spec.json"), spec_file.read_bytes())
    return spec_file


def start_launcher(argv: list[str], spec: TrainSpec) -> subprocess.Popen:
    """The plan's launcher, its output (every rank's) on one pipe, in its own process group: when this process is
    cancelled (a Prefect cancel sends SIGTERM to the flow run only) or interrupted, the launcher and every rank
    are stopped with it (``stop_process(..., group=True)``), never orphaned."""
    return subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=worker_env(spec), start_new_session=True
    )


def launch(
    spec: TrainSpec,
    on_progress: ProgressFn | None = None,
    on_line: Callable[[str], None] | None = None,
    on_command: Callable[[str], None] | None = None,
) -> TrainResult:
    """Run the planned training on this machine to completion and return what it reports.

    The result is read back from the artifact store, where rank 0 wrote it.
    ``on_command`` receives the launch command as a pasteable string.

    Raises:
        TrainingFailed: a process exited non-zero (its last output lines are included).
    """
    from ladle import strategies

    strategies.get(spec.plan.strategy).before_launch(spec.plan)
    relay = Relay(on_progress, on_line)
    with tempfile.TemporaryDirectory(prefix="ladle-train-") as tmp:
        spec_file = write_spec(spec, tmp)
        port = free_port()
        argv = spec.plan.launcher_argv([str(spec_file)], port=port)
        if on_command:
            on_command(spec.plan.launch_command([str(spec_file)], port=port))
            for rank in range(1, spec.plan.num_machines):
                on_command(f"waiting for node {rank} to join; on it run: " + join_command(spec, rank))
        proc = start_launcher(argv, spec)
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                relay.feed(line)
            code = proc.wait()
        except BaseException:  # cancelled or interrupted: the ranks checkpoint their step first (preempt)
            stop_process(proc, grace_s=spec.config.training.preempt_grace_s + 10, group=True)
            raise
    if code == PREEMPTED or (code != 0 and relay.preempted):  # torchrun reports the ranks' 75 as its own failure
        raise preempted(spec, relay)
    if code != 0:
        raise relay.failure(f"training exited with code {code}")
    return read_result(spec)


class TrainingPreempted(TrainingFailed):
    """The run was told to stop and checkpointed the step it had finished; it resumes from there."""

    def __init__(self, message: str, step: int | None):
        super().__init__(message)
        self.step = step


def preempted(spec: TrainSpec, relay: Relay) -> TrainingPreempted:
    step = relay.preempted[-1] if relay.preempted else None
    return TrainingPreempted(
        f"training was told to stop and checkpointed step {step} (exit {PREEMPTED}); run it again with the same "
        "run id to resume from there (a retry of the train task does)",
        step,
    )
