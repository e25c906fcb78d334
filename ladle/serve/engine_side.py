"""The engine process of a model server: the model, the continuous-batching loop, and two threads that move
``ladle.serve.wire`` messages (this module's main thread receives, a sender thread reports).

It is started by the API process (``ladle.serve.client``), forked from it after the libraries were imported (so
it costs the model's load, not the imports again) or, when the API process already runs other threads, as a new
interpreter. It never outlives the API process: the kernel kills it when its parent dies
(``PR_SET_PDEATHSIG``), and it exits on its own when the pipe closes. SIGTERM and SIGINT are the API process's
to handle: a stop sent to the server's process group drains the requests in flight, which need this process
until the API process closes the pipe.

One engine process per model server, on the devices ``ladle.machine.placement.load_placed`` chooses: one GPU, or
a model too large for one spread over every visible GPU. Several models on one host are several servers, each
given its GPUs by ``CUDA_VISIBLE_DEVICES``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import threading
import time

from ladle.serve import wire

ENGINE_THREADS = "LADLE_ENGINE_THREADS"
"""The environment variable that carries the engine's thread count past the API process's one thread
(``ladle.serve.__main__.one_thread_until_fork``)."""

HEARTBEAT_S = 0.25
"""Seconds between reports when nothing happens (the API process's queue depth and health stay current)."""


def die_with_parent() -> None:
    """SIGKILL this process when the process that started it dies (Linux; elsewhere the pipe's end of file
    stops it)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def main(conn, model_dir: str, options: dict, parent: int) -> None:
    """The engine process's life: load, report ``Loaded`` (or ``LoadFailed``), then serve until the pipe closes."""
    die_with_parent()
    import setproctitle

    setproctitle.setproctitle(f"ladle-engine of {setproctitle.getproctitle()}")
    if os.getppid() != parent:  # the API process died before the line above took effect
        os._exit(0)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    threads = os.environ.pop(ENGINE_THREADS, None)
    if threads is not None:  # the API process ran on one thread so that it could fork this one
        import torch

        os.environ["OMP_NUM_THREADS"] = threads
        torch.set_num_threads(int(threads))
    from ladle.errors import LadleError
    from ladle.platform.startup import quiet_collector
    from ladle.serve.transformers_backend import TransformersBackend

    try:
        with quiet_collector():
            backend = TransformersBackend(model_dir, **options)
    except (LadleError, OSError, ValueError) as exc:
        conn.send(wire.LoadFailed(str(exc)))
        os._exit(2)
    except Exception as exc:  # noqa: BLE001 - any failure to load is reported to the API process, then fatal
        conn.send(wire.LoadFailed(f"{type(exc).__name__}: {exc}"))
        os._exit(2)
    side = EngineSide(conn, backend)
    conn.send(wire.Loaded(os.getpid(), str(backend.engine.device)))
    side.serve()


class EngineSide:
    """The engine's end of the pipe: jobs from ``Submit`` messages, their events batched into ``Report``s. The
    engine thread sends each turn's events itself, at the end of the turn (one message, no hand-over to another
    thread); a heartbeat thread reports the queue and health when the engine is idle."""

    def __init__(self, conn, backend) -> None:
        self.conn, self.backend, self.engine = conn, backend, backend.engine
        self.jobs: dict[int, object] = {}
        self.events: list[tuple[int, str, dict]] = []
        self.batches: list[int] = []
        self.received = 0
        self.lock = threading.Lock()  # one sender at a time: the engine thread, the heartbeat, the receiver
        self.sent_at = time.monotonic()
        self.engine.on_batch = self.record_batch
        self.engine.after_turn = self.flush
        threading.Thread(target=self.heartbeat, name="ladle-engine-heartbeat", daemon=True).start()

    def serve(self) -> None:
        """Take messages until the API process closes the pipe (or dies); then exit."""
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                os._exit(0)
            if isinstance(message, wire.Submit):
                self.submit(message)
            elif isinstance(message, wire.Adapter):
                if message.path is None:
                    self.backend.drop_adapter(message.key)
                else:
                    self.backend.add_adapter(message.key, message.path, message.size)
            elif isinstance(message, wire.Cancel):
                job = self.jobs.pop(message.key, None)
                if job is not None:
                    job.cancelled.set()

    def submit(self, message: wire.Submit) -> None:
        from ladle.serve.rows import Job
        from ladle.serve.structured import GrammarError

        key = message.key
        job = Job(**message.request)
        job.emit = lambda kind, data: self.post(key, job, kind, data)
        self.jobs[key] = job
        try:
            if message.grammar is not None:
                job.constraint = self.backend.grammars().constraint(message.grammar)
        except GrammarError as exc:
            self.received = message.seq
            job.emit("error", {"message": f"Invalid response_format: {exc}.", "status": 400, "param": exc.param})
            self.flush()  # answered here, not by a turn of the engine
            return
        self.backend.submit(job)
        self.received = message.seq  # after the submit: the engine's depth counts it from here

    def post(self, key: int, job, kind: str, data: dict) -> None:
        """``job.emit`` in this process: the event goes to the next report, with the token ids generated since the
        job's last event (``ids``: the API process keeps ``job.tokens`` too, which tool calls are read from) and,
        on its first event, the prompt's log-probabilities when an echo asked for them."""
        data = {**data, "ids": job.tokens[job.ids_sent :]}
        job.ids_sent = len(job.tokens)
        if job.prompt_logprobs is not None and not job.prompt_sent:
            data["prompt_logprobs"], job.prompt_sent = job.prompt_logprobs, True
        if kind in ("done", "error"):
            self.jobs.pop(key, None)
        with self.lock:
            self.events.append((key, kind, data))

    def record_batch(self, size: int) -> None:
        with self.lock:
            self.batches.append(size)

    def flush(self, heartbeat: bool = False) -> None:
        """Send what was emitted since the last report, and the engine's state; the API process gone: exit."""
        with self.lock:
            if not (self.events or self.batches or heartbeat):
                return
            events, self.events = self.events, []
            batches, self.batches = self.batches, []
            healthy = self.engine.healthy() and self.engine.alive()
            report = wire.Report(events, self.engine.depth(), self.received, healthy, batches)
            try:
                self.conn.send(report)
            except (OSError, ValueError):
                os._exit(0)
            self.sent_at = time.monotonic()

    def heartbeat(self) -> None:
        """The state every ``HEARTBEAT_S`` while no turn reported (the engine idle, or in a long prefill)."""
        while True:
            time.sleep(HEARTBEAT_S)
            if time.monotonic() - self.sent_at >= HEARTBEAT_S:
                self.flush(heartbeat=True)


if __name__ == "__main__":  # a new interpreter, when the API process could not fork (ladle.serve.client)
    import json
    import sys
    from multiprocessing.connection import Connection

    fd, model_dir, options, parent = sys.argv[1:]
    main(Connection(int(fd)), model_dir, json.loads(options), int(parent))
    os._exit(0)
