"""The API process's side of a split model server: the transformers backend with its engine in a process of
its own (``ladle.serve.engine_side``), reached over ``ladle.serve.wire``.

This process keeps the tokenizer (requests are tokenized and validated here, and their token counts checked
before the engine sees them) and forwards each request's events to its handler. What runs here per decode step
is one message read and the events handed to the event loop: the forwards, the sampling, the grammar masks and
the detokenization run in the engine process, under its own interpreter lock, so a health check or a new
request's parsing never waits behind a step, and a step never waits behind them.

The engine process dying is final for this server: every request in flight gets a 503 naming it, ``/health``
and ``/ready`` turn red, and the server exits with status 1 (``on_death``), so whatever supervises it (the
front, Kubernetes, systemd) starts it again. Nothing is left behind: the engine process is killed by the kernel
if this one dies first.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

from ladle.errors import LadleError
from ladle.serve import wire
from ladle.serve.transformers_backend import TransformersBackend

LOAD_TIMEOUT_S = 3600.0
"""The longest the engine process may take to load the model (an 8B from a network disk takes minutes); past it
the server gives up and says so."""

STOP_GRACE_S = 10.0
DEATH_CHECK_S = 1.0  # without a report for this long, the reader asks whether the engine process still runs
"""Seconds the engine process has to exit once its pipe is closed, before it is killed."""


class GrammarText(str):
    """A request's grammar in the API process: validated here, compiled into a matcher by the engine process."""


class TextGrammars:
    """``backend.grammars()`` of the API process: a grammar passes through as its text (the engine process owns
    the tokenizer's llguidance view and each request's matcher)."""

    def constraint(self, grammar: str) -> GrammarText:
        return GrammarText(grammar)


class EngineClient(TransformersBackend):
    """The transformers backend, its engine in a child process; what the server sees is the same ``Backend``."""

    def __init__(
        self, model_dir: str, max_batch: int = 32, kv_tokens: int = 0, max_adapters: int = 8, adapters_mb: float = 0.0
    ):
        from transformers import AutoConfig

        from ladle.platform.processes import other_threads

        self.check_options(max_batch, kv_tokens, max_adapters, adapters_mb)
        self.model_dir = model_dir
        config = AutoConfig.from_pretrained(model_dir).get_text_config(decoder=True)
        self.sized(config, max_batch, kv_tokens)
        self.on_death: Callable[[], None] | None = None
        self.jobs: dict[int, object] = {}
        self.keys = itertools.count(1)
        self.seq = self.received = self.depth = 0
        self.healthy, self.dead = True, None
        self.observe_batch: Callable[[int], None] = lambda size: None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        ours, theirs = socket.socketpair()
        options = {
            "max_batch": max_batch,
            "kv_tokens": kv_tokens,
            "max_adapters": max_adapters,
            "adapters_mb": adapters_mb,
        }
        # Forked: the child has every library this process imported (a start costs the model's load). With other
        # threads running, a fork would copy locks they hold: a new interpreter then.
        self.forked = not other_threads()
        self.proc = self.reader = self.code = None
        self.reaping = threading.Lock()
        if self.forked:
            self.pid = self.fork(ours, theirs, model_dir, options)
        else:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "ladle.serve.engine_side",
                    str(theirs.fileno()),
                    model_dir,
                    json.dumps(options),
                    str(os.getpid()),
                ],
                pass_fds=(theirs.fileno(),),
            )
            self.pid = self.proc.pid
        theirs.close()
        self.sock = ours  # shut down by ``close``: both threads' ends of file, without closing under a reader
        self.conn = Connection(os.dup(ours.fileno()))
        try:
            loaded = self.wait_loaded(model_dir)
        except BaseException:
            self.close()
            raise
        self.device = loaded.device
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)  # after the fork: no tokenizer threads copied
        self.reader = threading.Thread(target=self.read, name="ladle-engine-read", daemon=True)
        self.reader.start()
        threading.Thread(target=self.write, name="ladle-engine-write", daemon=True).start()

    @staticmethod
    def fork(ours: socket.socket, theirs: socket.socket, model_dir: str, options: dict) -> int:
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # the engine process; it never returns here
            code = 1
            try:
                ours.close()
                from ladle.serve import engine_side

                engine_side.main(Connection(theirs.detach()), model_dir, options, parent)
                code = 0
            finally:
                os._exit(code)
        return pid

    def exit_code(self) -> int | None:
        """The engine process's exit status once it ended (reaped here, by one thread at a time), else None."""
        if self.proc is not None:
            return self.proc.poll()
        with self.reaping:
            if self.code is None:
                try:
                    done, status = os.waitpid(self.pid, os.WNOHANG)
                except ChildProcessError:
                    done, status = self.pid, 0
                if done == self.pid:
                    self.code = os.waitstatus_to_exitcode(status)
        return self.code

    def wait_loaded(self, model_dir: str) -> wire.Loaded:
        """The engine's ``Loaded`` message, with a deadline.

        Raises:
            LadleError: it could not load the model (its reason), died, or took longer than ``LOAD_TIMEOUT_S``.
        """
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.conn.poll(0.2):
                try:
                    message = self.conn.recv()
                except (EOFError, OSError):
                    message = None
                if isinstance(message, wire.Loaded):
                    return message
                if isinstance(message, wire.LoadFailed):
                    raise LadleError(message.message)
                code = self.wait_exit(5.0)
                raise LadleError(f"{model_dir}: the engine process exited with code {code} while loading the model.")
            code = self.exit_code()
            if code is not None:
                raise LadleError(f"{model_dir}: the engine process exited with code {code} while loading the model.")
        raise LadleError(f"{model_dir}: the engine process did not load the model within {LOAD_TIMEOUT_S:.0f} s.")

    def wait_exit(self, seconds: float) -> int | None:
        deadline = time.monotonic() + seconds
        while (code := self.exit_code()) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return code

    def grammars(self) -> TextGrammars:
        return TextGrammars()

    def report_batches(self, observe: Callable[[int], None]) -> None:
        self.observe_batch = observe

    def submit(self, job) -> None:
        if self.dead:
            job.emit("error", {"message": self.dead, "status": 503, "code": "engine_down"})
            return
        if self.loop is None:
            self.loop = asyncio.get_running_loop()  # the server's: submit is called on it
        job.key = next(self.keys)
        self.seq += 1
        self.jobs[job.key] = job
        grammar = job.constraint if isinstance(job.constraint, GrammarText) else None
        self.outbox.put(wire.Submit.of(job, job.key, self.seq, grammar))

    def add_adapter(self, key: str, path: str, size: int) -> None:
        self.outbox.put(wire.Adapter(key, path, size))

    def drop_adapter(self, key: str) -> None:
        self.outbox.put(wire.Adapter(key))

    def cancel(self, job) -> None:
        job.cancelled.set()
        if self.jobs.pop(getattr(job, "key", None), None) is not None:
            self.outbox.put(wire.Cancel(job.key))

    def live(self) -> bool:
        return self.dead is None and self.healthy

    def queue_depth(self) -> int:
        """Requests waiting for the batch: the engine's count at its last report, and those sent since that it
        had not taken yet."""
        return self.depth + max(0, self.seq - self.received)

    def write(self) -> None:
        """Send the outbox in order (the event loop only queues: it never waits on the pipe)."""
        while (message := self.outbox.get()) is not None:
            try:
                self.conn.send(message)
            except (OSError, ValueError):
                return

    def read(self) -> None:
        """Hand each report's events to their requests, until the engine process is gone: its end of the pipe
        closed, or, checked each ``DEATH_CHECK_S`` without a report, its exit status there (a process it started
        that outlived it and kept the pipe open must not hide its end)."""
        while True:
            try:
                if not self.conn.poll(DEATH_CHECK_S):
                    if self.exit_code() is not None:
                        break
                    continue
                report = self.conn.recv()
            except (EOFError, OSError, ValueError):
                break
            self.depth, self.received, self.healthy = report.depth, report.received, report.healthy
            for size in report.batches:
                self.observe_batch(size)
            deliveries = []
            for key, kind, data in report.events:
                job = self.jobs.get(key)
                if job is None:  # cancelled here meanwhile
                    continue
                if kind in ("done", "error"):
                    self.jobs.pop(key, None)
                deliveries.append((job, kind, data))
            if deliveries:  # one wake-up of the event loop per report, not one per request
                self.loop.call_soon_threadsafe(self.deliver, deliveries)
        if self.dead is None:
            self.gone()

    @staticmethod
    def deliver(deliveries: list) -> None:
        """On the event loop: each event to its request, its token ids first (tool calls are read from them)."""
        for job, kind, data in deliveries:
            job.tokens += data.pop("ids", ())
            if "prompt_logprobs" in data:
                job.prompt_logprobs = data.pop("prompt_logprobs")
            if job.deliver is not None:
                job.deliver((kind, data))
            else:
                job.emit(kind, data)

    def gone(self) -> None:
        """The engine process ended under us: fail what is in flight, turn red, and let the server exit."""
        code = self.wait_exit(2.0)
        self.dead = (
            f"the engine process of this server exited (code {code}); the server is restarting. Retry the request."
        )
        print(f"ladle server: {self.dead}", file=sys.stderr, flush=True)
        for key in list(self.jobs):
            job = self.jobs.pop(key, None)
            if job is not None:
                job.emit("error", {"message": self.dead, "status": 503, "code": "engine_down"})
        if self.on_death is not None:
            self.on_death()

    def close(self) -> None:
        """Close the pipe (the engine process exits at its end of file); kill it if it has not within
        ``STOP_GRACE_S``."""
        self.dead = self.dead or "the server is stopping"
        self.outbox.put(None)
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        if self.wait_exit(STOP_GRACE_S) is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            self.wait_exit(STOP_GRACE_S)
        if self.reader is not None:
            self.reader.join(timeout=STOP_GRACE_S)
        self.conn.close()
        self.sock.close()
