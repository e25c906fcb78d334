"""Training launches started from a fork server that imported the launcher's libraries once.

``ladle.train.run.launch`` starts ``python -m ladle.train.launch ...`` as a new interpreter, which imports torch,
transformers, peft and accelerate (~3.3 s of CPU on a 2-core host) before it forks the ranks. The training
modules that compare strategies, meshes and losses launch dozens of short runs between them, and what they prove
is what the ranks compute, not how the launcher's interpreter starts. Their fixture ``warm_launches`` (in
``tests/train/conftest.py``) has each launch forked from multiprocessing's fork server instead: the child puts
itself in its own session, takes the launch's environment and working folder, sends its output (and every
rank's) down a pipe, and runs the very ``ladle.train.launch.main`` with the very arguments ``launch`` built;
``launch`` reads, waits for and stops it through the same calls as a ``subprocess.Popen``.

The real start is what the rest of the suite uses: the launcher's own tests (``tests/train/test_launch.py``: its
arguments, kills and exits), every ``ladle run`` and every flow run.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys

PRELOAD = [
    "torch",
    "torch.distributed",
    "ladle.train.runtime",
    "ladle.train.launch",
    "ladle.train.worker",
    "peft",
    "accelerate.commands.launch",
    "accelerate.utils.launch",
    "transformers.models.llama.modeling_llama",
]
"""What the fork server imports (in a process that has run no torch op, so no OpenMP pool is forked): the
launcher's preload for the tiny Llama, and what ``tests.helpers.run_ranks``'s ranks import (one server serves
both)."""


def context():
    """multiprocessing's fork-server context, with the suite's one preload list."""
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def run_launcher(argv: list[str], env: dict[str, str], cwd: str, out) -> None:
    """In the fork server's child: become ``python -m ladle.train.launch ARGV`` with ``env``, in its own session,
    its stdout and stderr on ``out``; never returns."""
    code = 1
    try:
        os.setsid()
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
        out.close()
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True)
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        import torch

        if env.get("OMP_NUM_THREADS", "").isdigit():  # what torch reads from it when it loads
            torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
        from ladle.train import launch

        sys.argv = [launch.__file__, *argv]
        code = launch.main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code if 0 <= code < 256 else 1)


class WarmLauncher:
    """What ``launch`` uses of a ``subprocess.Popen``: ``pid``, ``stdout`` (text lines), ``poll``, ``wait`` and
    ``returncode``, for a launcher forked by the fork server (not this process's child: its exit code comes from
    multiprocessing)."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        ctx = context()
        read, write = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=run_launcher, args=(argv, env, os.getcwd(), write), daemon=False)
        self.process.start()
        write.close()
        self.pid = self.process.pid
        self.stdout = io.TextIOWrapper(io.FileIO(os.dup(read.fileno()), "r"), encoding="utf-8", errors="replace")
        read.close()
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and self.process.exitcode is not None:
            self.returncode = self.process.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self.process.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired("ladle.train.launch", timeout)
        return self.returncode


def start_warm(argv: list[str], spec, real):
    """``ladle.train.run.start_launcher``'s stand-in: fork-launcher runs from the fork server, anything else
    (``accelerate launch`` for several machines or GPUs) the real way."""
    from ladle.train.run import worker_env

    if argv[1:3] != ["-m", "ladle.train.launch"]:
        return real(argv, spec)
    return WarmLauncher(argv[3:], worker_env(spec))
