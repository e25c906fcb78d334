"""The launcher of CPU training runs: ``accelerate launch``'s arguments and environment, ranks forked from one
process that imported the worker's libraries once.

    python -m ladle.train.launch --multi_gpu --num_processes 2 ... -m ladle.train.worker SPEC.json

``accelerate launch`` hands the ranks to torchrun, which starts each as a new interpreter; every rank then
imports torch, transformers, peft and accelerate again (~4 s of CPU each on a 2-core host, ~1.5 s more for
the launcher itself), most of a short CPU run. This launcher parses the same arguments with accelerate's own
parser and builds the ranks' environment with accelerate's own functions (the ``ACCELERATE_*`` settings), sets
torchrun's variables for each rank (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...), imports
what every rank would, and forks the ranks from itself. It starts one machine's run: across machines, runs keep
``accelerate launch``, whose torchrun agents meet every node before a rank starts, under a join deadline.
Nothing it imports starts a thread or touches a device (pyarrow, whose allocator starts a thread when it loads,
is imported by the ranks after the fork), and it checks: with any other thread running it starts the ranks as
new interpreters instead, and says so. Each rank's process group meets at ``MASTER_ADDR:MASTER_PORT`` as it
does under torchrun.

It supervises as torchrun does: when a rank fails, the others are stopped (SIGHUP, then SIGKILL after
``GRACE_S``) and the launcher exits with the failed rank's code; a SIGINT or SIGHUP to the launcher stops every
rank the same way; a SIGTERM or SIGUSR1 (a cluster's "stop soon") is passed to the ranks, which checkpoint their
step and exit 75 (``ladle.train.preempt``), waited for up to ``training.preempt_grace_s``; a rank whose launcher
is killed outright is ended by the kernel (``PR_SET_PDEATHSIG``).

GPU runs keep ``accelerate launch`` (the path measured on GPUs): a device initialised before a fork is not
usable in the child, and this launcher has not yet run on a GPU. The plan picks the launcher
(``Plan.launcher_argv``).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import sys
import time
import traceback
from pathlib import Path

from ladle.platform.processes import other_threads
from ladle.platform.startup import quiet_collector

WORKER = "ladle.train.worker"
GRACE_ENV = "LADLE_PREEMPT_GRACE_S"
"""training.preempt_grace_s, for the launchers (set in the ranks' environment by ``ladle.train.run.worker_env``)."""
GRACE_S = 10.0
"""Seconds the other ranks get to stop after one failed (or after the launcher was asked to stop)."""


class LaunchRefused(Exception):
    """The arguments ask for something this launcher does not start (named in the message)."""


def rank_layout(argv: list[str]) -> tuple[list[dict[str, str]], list[str]]:
    """Each local rank's environment (in local-rank order) and the worker's arguments, from ``accelerate
    launch`` arguments; accelerate's parser, validation and environment functions do the reading."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env, prepare_simple_launcher_cmd_env

    args = launch_command_parser().parse_args(argv)
    if not args.module or args.training_script != WORKER:
        raise LaunchRefused(f"it starts only `-m {WORKER}` (got {args.training_script!r}); use accelerate launch")
    args, _, _ = _validate_launch_command(args)
    if not args.multi_gpu:  # one process: accelerate's simple launcher (the worker makes its one-rank group)
        _, env = prepare_simple_launcher_cmd_env(args)
        return [env], list(args.training_script_args)
    if args.use_deepspeed or args.use_fsdp or args.use_megatron_lm or args.tpu:
        raise LaunchRefused("ladle applies every strategy in the worker; accelerate's own engine flags are not used")
    if int(args.num_machines) > 1:
        raise LaunchRefused(
            "it starts one machine's run; across machines use accelerate launch, whose torchrun agents meet every "
            "node before any rank starts, under a join deadline"
        )
    base = prepare_multi_gpu_env(args)
    world = int(args.num_processes)
    port = args.main_process_port
    if getattr(args, "standalone", False):  # the port was taken: torchrun's standalone mode picks a free one
        from ladle.platform.processes import free_port

        port = free_port()
    run_id = base.get("TORCHELASTIC_RUN_ID", f"ladle-{os.getpid()}")
    ranks = []
    for rank in range(world):  # torchrun's variables, as its agent sets them on one machine
        env = dict(base)
        env.update(
            {
                "LOCAL_RANK": str(rank),
                "RANK": str(rank),
                "GROUP_RANK": "0",
                "ROLE_RANK": str(rank),
                "ROLE_NAME": "default",
                "LOCAL_WORLD_SIZE": str(world),
                "WORLD_SIZE": str(world),
                "GROUP_WORLD_SIZE": "1",
                "ROLE_WORLD_SIZE": str(world),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "TORCHELASTIC_RESTART_COUNT": "0",
                "TORCHELASTIC_MAX_RESTARTS": "0",
                "TORCHELASTIC_RUN_ID": run_id,
                "TORCHELASTIC_USE_AGENT_STORE": "False",
            }
        )
        ranks.append(env)
    return ranks, list(args.training_script_args)


def preload(worker_args: list[str]) -> None:
    """Import what every rank imports before its first weight: the worker, its strategy's runtime and engine,
    peft and the base model's transformers class (read from the spec; nothing is loaded or run)."""
    from ladle.train import worker
    from ladle.train.runtime.base import runtime_for
    from ladle.train.spec import TrainSpec

    spec = TrainSpec.model_validate_json(Path(worker_args[0]).read_text(encoding="utf-8"))
    worker.warm_imports(runtime_for(spec.plan.strategy))
    name = architecture_class(Path(spec.base_dir))
    if name:
        import transformers

        getattr(transformers, name)  # imports the architecture's module


def architecture_class(base: Path) -> str | None:
    """transformers' causal-LM class name for the base's ``config.json``; None when it cannot be read here (the
    worker then fails on it with its own message, naming the file) or names no known architecture."""
    from transformers.models.auto import modeling_auto

    try:
        model_type = json.loads((base / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)


def run_rank(env: dict[str, str], worker_args: list[str], launcher: int) -> int:
    """In the forked child: become the rank ``python -u -m ladle.train.worker`` would have been, run it, and
    return its exit code. Never returns to the launcher's code."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    set_parent_death_signal(signal.SIGKILL)  # the launcher gone: nobody reads a checkpoint's outcome
    name_process(f"ladle-rank{env.get('RANK', '0')}")
    if os.getppid() != launcher:  # the launcher died between the fork and the line above
        return 1
    os.environ.clear()
    os.environ.update(env)
    own_threads(env)
    random.seed()  # a new interpreter's random state, not a copy of the launcher's
    from ladle.train import worker

    sys.argv = [worker.__file__, *worker_args]
    try:
        return worker.main(worker_args)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
        worker.exit_now(1)  # inside the handler: the traceback's frames are never freed (``worker.KEPT``)


def prctl(option: int, value) -> None:
    """Linux's prctl(2); nothing elsewhere."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def set_parent_death_signal(sig: int) -> None:
    """Linux: the kernel sends ``sig`` to this process when its parent (the launcher) dies."""
    prctl(1, int(sig))  # PR_SET_PDEATHSIG


def name_process(name: str) -> None:
    """The rank's name in ``top`` and ``ps -o comm`` (its command line stays the launcher's)."""
    prctl(15, name.encode()[:15])  # PR_SET_NAME


def fork_rank(env: dict[str, str], worker_args: list[str]) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    launcher = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        code = run_rank(env, worker_args, launcher)
    finally:
        # As the worker's own entry point ends: output flushed, the interpreter's teardown skipped.
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code if 0 <= code < 256 else 1)


def exec_rank(env: dict[str, str], worker_args: list[str]) -> int:
    """Start the rank as a new interpreter (``python -u -m ladle.train.worker``), as torchrun would."""
    import subprocess

    proc = subprocess.Popen([sys.executable, "-u", "-m", WORKER, *worker_args], env=env)
    STARTED[proc.pid] = proc  # kept, so that the Popen object does not outlive its process unreaped
    return proc.pid


STARTED: dict = {}


def say(message: str) -> None:
    print(f"ladle launch: {message}", file=sys.stderr, flush=True)


def stop(pids: dict[int, int], grace_s: float = GRACE_S) -> None:
    """SIGHUP every rank still running (its default action ends it: SIGTERM would ask it to checkpoint first,
    ``ladle.train.preempt``, which a rank whose peer died cannot), SIGKILL those still there after ``grace_s``;
    reaps them all."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGHUP)
    deadline = time.monotonic() + grace_s
    while pids and time.monotonic() < deadline:
        reap(pids)
        time.sleep(0.05)
    for pid in list(pids):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pids.pop(pid)


def reap(pids: dict[int, int]) -> list[tuple[int, int]]:
    """(rank, exit code) of each rank that ended since the last look; negative codes are signals."""
    ended = []
    for pid in list(pids):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            ended.append((pids.pop(pid), os.waitstatus_to_exitcode(status)))
    return ended


def describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class Stopped(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def supervise(pids: dict[int, int]) -> int:
    """Wait for every rank; the first failure stops the rest. Returns the launcher's exit code: the failed
    rank's (128 + the signal that killed it).

    Ranks found ended at the same look are told apart by cause: a rank killed by a signal (the OOM killer, a
    user's kill) comes before one that exited with an error, which is what its peers do when a collective
    loses a member."""
    while pids:
        failed = sorted((c for c in reap(pids) if c[1] != 0), key=lambda c: (c[1] > 0, c[0]))
        if failed:
            rank, code = failed[0]
            also = "".join(f"; rank {r} {describe(c)}" for r, c in failed[1:])
            say(f"rank {rank} {describe(code)}{also}; stopping the other {len(pids)} rank(s)")
            stop(pids)
            return code if code > 0 else 128 - code
        time.sleep(0.05)
    return 0


def preempt(pids: dict[int, int], signum: int) -> int:
    """Pass ``signum`` to every rank (each finishes its step, they checkpoint together and exit ``PREEMPTED``) and
    wait for them up to ``training.preempt_grace_s`` (``LADLE_PREEMPT_GRACE_S``); ranks still running then are
    stopped. Returns ``PREEMPTED`` when every rank checkpointed, else the first other exit code."""
    from ladle.train.preempt import PREEMPTED

    grace = float(os.environ.get(GRACE_ENV, "120"))
    say(f"{signal.Signals(signum).name}: {len(pids)} rank(s) checkpoint after their step (grace {grace:g} s)")
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)
    codes: list[int] = []
    deadline = time.monotonic() + grace
    while pids and time.monotonic() < deadline:
        codes += [code for _, code in reap(pids)]
        time.sleep(0.05)
    if pids:
        say(f"{len(pids)} rank(s) did not finish their checkpoint within {grace:g} s; stopping them")
        stop(pids)
        return 128 + signum
    failed = [code for code in codes if code != PREEMPTED]
    if failed:
        return failed[0] if failed[0] > 0 else 128 - failed[0]
    say(f"every rank checkpointed; exiting {PREEMPTED} to be requeued")
    return PREEMPTED


def threads_before_torch(argv: list[str]) -> None:
    """torchrun's rule, applied before anything imports torch: one thread per rank when several share a machine
    and the user set none (the ranks' environment is built from this one). ladle's own launches always set it (a
    rank's share of the cores)."""
    if "OMP_NUM_THREADS" in os.environ or "--multi_gpu" not in argv:
        return
    values = dict(zip(argv, argv[1:], strict=False))
    try:
        processes = int(values.get("--num_processes", "1"))
    except ValueError:
        return  # accelerate's parser names the bad value next
    if processes > 1:
        os.environ["OMP_NUM_THREADS"] = "1"


@contextlib.contextmanager
def one_openmp_thread():
    """Imports made here load OpenMP and OpenBLAS with one thread (``OMP_NUM_THREADS=1``); the variable is put back
    as it was after them (the ranks' environment is built from it). Each reads it once, when it loads, and with more
    than one thread starts its worker threads at once (torch's OpenMP at import, numpy's OpenBLAS at its first
    import), so that the launcher of ranks with more than one thread each (a one-process CPU run, 2 ranks on 4
    cores) found threads running and started its ranks as new interpreters: 12.6 s to the first step of a
    one-process tiny run on 2 cores instead of 6 s. Each forked rank sets its own count back (``own_threads``), as
    the model server's engine process does (``ladle.serve.engine_side``)."""
    asked = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        yield
    finally:
        if asked is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = asked


def own_threads(env: dict[str, str]) -> None:
    """In a forked rank: the intra-op thread count a new interpreter would have taken from ``env`` (the launcher
    loaded torch on one). Unset, torch's own default applies when it first computes in parallel."""
    import torch

    try:
        threads = int(env.get("OMP_NUM_THREADS", "0"))
    except ValueError:
        return  # OpenMP ignores a value it cannot read; so does this
    if threads > 0:
        torch.set_num_threads(threads)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    threads_before_torch(argv)
    # Python's documented recipe for a process that forks without exec (ladle.platform.startup): no cyclic
    # collection while the imports build their long-lived objects, which are frozen before the ranks fork, so
    # that no rank's collector walks (and copies) their pages.
    with quiet_collector():
        with one_openmp_thread():
            import accelerate.commands.launch  # noqa: F401 - torch with it
            import accelerate.utils.launch  # noqa: F401
            import numpy  # noqa: F401
        try:
            ranks, worker_args = rank_layout(argv)  # the environment as given: the ranks' is built from it
        except LaunchRefused as exc:
            say(f"refused: {exc}")
            return 2
        if len(worker_args) != 1:
            say(f"usage: python -m ladle.train.launch [accelerate launch arguments] -m {WORKER} SPEC.json")
            return 2
        with one_openmp_thread():
            preload(worker_args)

    def on_signal(signum, _frame):
        raise Stopped(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
        signal.signal(sig, on_signal)
    threads = other_threads()
    if threads:
        say(
            f"{len(threads)} other thread(s) running after the imports ({', '.join(threads)}): forking would copy "
            "their locks held; starting each rank as a new interpreter instead"
        )
    start = exec_rank if threads else fork_rank
    pids: dict[int, int] = {}
    try:
        for env in ranks:
            pids[start(env, worker_args)] = int(env.get("RANK", "0"))
        return supervise(pids)
    except Stopped as exc:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
            signal.signal(sig, signal.SIG_IGN)
        if exc.signum in (signal.SIGTERM, signal.SIGUSR1) and pids:  # the cluster says stop: checkpoint first
            return preempt(pids, exc.signum)
        say(f"{signal.Signals(exc.signum).name}: stopping {len(pids)} rank(s)")
        stop(pids)
        return 128 + exc.signum


if __name__ == "__main__":
    code = main()
    # As the worker does: the interpreter's teardown of torch and its libraries costs ~1.3 s and writes nothing.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
