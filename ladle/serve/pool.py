"""Warm starts for model servers: a parent that imported the server's libraries once forks each server.

A server started as ``python -m ladle.serve`` spends its first seconds importing torch, transformers and the web
stack (``bench/serve_split.py`` measures it per start) before it reads a byte of weights. A pool is a process that
has done that once and stays idle:

    python -m ladle.serve.pool --socket PATH        # or LADLE_SERVE_POOL=PATH in its environment

and every server started while ``LADLE_SERVE_POOL`` names its socket (by ``ladle model serve``, a deploy, the
front's supervisor restarting one, the test suite) is forked from it, so a start costs the model's load. The
forked server is the same program with the same arguments: its own session and log, its engine forked from it in
turn (``ladle.serve.client``). The pool never ran a torch operation and runs one thread, so a fork copies no
lock and no OpenMP pool (torch's OpenMP runtime cannot be used in a child once the parent used it).

What a caller gets is ``Started``, a handle with ``subprocess.Popen``'s ``pid``, ``poll``, ``wait``,
``send_signal``, ``terminate`` and ``kill``: the pool reaps its children and sends each one's exit status down the
connection that asked for it. A pool that is not running (no socket, or nobody answers on it) is a cold start,
said once on standard error; a server that cannot start warm is never a server that does not start.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ENV = "LADLE_SERVE_POOL"
"""The environment variable naming a pool's socket."""

CONNECT_TIMEOUT_S = 2.0
"""How long a caller waits for the pool to answer before starting the server cold."""

MODULE = ["-m", "ladle.serve"]

MAX_REQUEST_BYTES = 4 * 2**20
"""The longest request line the pool reads (an argv and an environment; a typical one is a few kilobytes)."""


def launch(argv: list[str], log_path: Path | None, env: dict[str, str] | None = None, append: bool = False):
    """Start a model server: forked from the pool named by ``LADLE_SERVE_POOL`` when one answers and ``argv`` is
    ``python -m ladle.serve ...``; else a new interpreter in its own session. Output goes to ``log_path``."""
    env = dict(os.environ if env is None else env)
    path = env.get(ENV)
    if path and argv[1:3] == MODULE:
        try:
            return Started.ask(path, argv, log_path, env, append)
        except OSError as exc:
            print(f"ladle: the server pool at {path} did not answer ({exc}); starting the server cold", file=sys.stderr)
    mode = "a" if append else "w"
    out = open(log_path, mode) if log_path is not None else subprocess.DEVNULL  # noqa: SIM115 - the child's
    try:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    finally:
        if out is not subprocess.DEVNULL:
            out.close()


class Started:
    """A server forked by the pool, handled as ``subprocess.Popen`` handles a child."""

    def __init__(self, args: list[str], pid: int, conn: socket.socket) -> None:
        self.args, self.pid, self.conn = args, pid, conn
        self.returncode: int | None = None
        self.buffer = b""

    @classmethod
    def ask(cls, path: str, argv: list[str], log_path: Path | None, env: dict, append: bool) -> Started:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.settimeout(CONNECT_TIMEOUT_S)
        try:
            conn.connect(path)
            request = {"argv": argv[3:], "log": str(log_path) if log_path else None, "env": env, "append": append}
            request["cwd"] = os.getcwd()
            conn.sendall(json.dumps(request).encode() + b"\n")
            line = read_line(conn, "the pool closed the connection before it started the server")
        except BaseException:
            conn.close()
            raise
        conn.settimeout(None)
        answer = json.loads(line)
        if "error" in answer:
            conn.close()
            raise OSError(answer["error"])
        return cls(argv, answer["pid"], conn)

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self.conn], [], [], 0)[0]:
            chunk = self.conn.recv(4096)
            self.buffer += chunk
            if self.buffer.endswith(b"\n"):
                self.returncode = json.loads(self.buffer)["exit"]
            elif not chunk:  # the pool itself is gone: the server's status is lost, not its end
                self.returncode = -1 if not alive(self.pid) else None
                if self.returncode is None:
                    return None
            if self.returncode is not None:
                self.conn.close()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            if self.conn.fileno() >= 0:
                select.select([self.conn], [], [], 0.05)
            else:
                time.sleep(0.05)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def read_line(conn: socket.socket, closed: str) -> bytes:
    """One JSON line from ``conn`` (its timeout bounds the wait).

    Raises:
        OSError: ``closed``, when the other side closed before the line ended; or the line is over
            ``MAX_REQUEST_BYTES``.
    """
    line = b""
    while not line.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            raise OSError(closed)
        line += chunk
        if len(line) > MAX_REQUEST_BYTES:
            raise OSError(f"a request line over {MAX_REQUEST_BYTES} bytes")
    return line


def alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def preload() -> None:
    """What every server imports, imported once here (and frozen out of the collector's scans)."""
    import setproctitle

    from ladle.platform.startup import quiet_collector

    setproctitle.getproctitle()  # its set-up, while the environment is the process's own (a child replaces it)
    with quiet_collector():
        import llguidance  # noqa: F401
        import torch  # noqa: F401
        import transformers  # noqa: F401
        import uvicorn  # noqa: F401
        from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

        import ladle.serve.client  # noqa: F401
        import ladle.serve.engine_side  # noqa: F401
        import ladle.serve.server  # noqa: F401
        import ladle.serve.structured  # noqa: F401


def child(request: dict, listener: socket.socket, conn: socket.socket, others) -> None:
    """In the forked server: its own session, log, environment and directory, then ``python -m ladle.serve``'s
    main. Never returns."""
    code = 1
    try:
        listener.close()
        for other in others:  # the connections of servers started before: theirs, not this one's
            other.close()
        os.setsid()
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        log = request.get("log")
        # A log is never reached through a link (truncating whatever it points at); a new one is its owner's only.
        flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if request["append"] else os.O_TRUNC)
        out = os.open(log, flags | os.O_NOFOLLOW, 0o600) if log else os.open(os.devnull, os.O_WRONLY)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        conn.close()
        from ladle.serve import engine_side

        threads = os.environ[engine_side.ENGINE_THREADS]
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ[engine_side.ENGINE_THREADS] = request["env"].get("OMP_NUM_THREADS", threads)
        os.environ["OMP_NUM_THREADS"] = "1"  # what this process was loaded with; the engine sets its own
        os.chdir(request["cwd"])
        sys.argv = [sys.executable, *MODULE, *request["argv"]]
        import setproctitle

        setproctitle.setproctitle(" ".join(sys.argv))  # what ps shows: the server it is, not the pool it came from
        from ladle.serve.__main__ import main

        code = main(request["argv"])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - the server's log says why it could not start
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def serve(path: str) -> int:
    """Fork a server for each request on the socket at ``path``; reap them and report their ends; until
    SIGTERM or SIGINT."""
    from ladle.serve.__main__ import one_thread_until_fork

    one_thread_until_fork()
    preload()
    Path(path).unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # The pool runs whatever server it is asked to, as its own user: only that user may ask. The socket is made
    # 0600 as it is bound (a umask), never open to others between bind and a chmod.
    mask = os.umask(0o177)
    try:
        listener.bind(path)
    finally:
        os.umask(mask)
    listener.listen(16)
    stopping = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.append(True))
    print(f"ladle server pool: ready on {path} (pid {os.getpid()})", flush=True)
    waiting: dict[int, socket.socket] = {}
    try:
        while not stopping:
            with contextlib.suppress(InterruptedError):
                if select.select([listener], [], [], 0.2)[0]:
                    start(listener, waiting)
            reap(waiting)
    finally:
        listener.close()
        Path(path).unlink(missing_ok=True)
    return 0


def start(listener: socket.socket, waiting: dict[int, socket.socket]) -> None:
    conn, _ = listener.accept()
    conn.settimeout(CONNECT_TIMEOUT_S)
    try:
        request = json.loads(read_line(conn, "the caller hung up"))
        pid = os.fork()
        if pid == 0:
            child(request, listener, conn, list(waiting.values()))
        conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        waiting[pid] = conn
    except (OSError, ValueError, KeyError) as exc:
        with contextlib.suppress(OSError):
            conn.sendall(json.dumps({"error": str(exc)}).encode() + b"\n")
        conn.close()


def reap(waiting: dict[int, socket.socket]) -> None:
    """Collect ended servers; tell whoever started each its exit status."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = waiting.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.sendall(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
            conn.close()


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m ladle.serve.pool", description=__doc__.split("\n\n")[0])
    parser.add_argument("--socket", default=os.environ.get(ENV), help=f"The socket's path (default: ${ENV}).")
    args = parser.parse_args(argv)
    if not args.socket:
        parser.error(f"--socket: give the socket's path, or set {ENV}")
    return serve(args.socket)


if __name__ == "__main__":
    sys.exit(main())
