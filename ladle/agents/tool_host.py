"""The training process's side of the tool host (``ladle.agents.host``): requests with deadlines, a host killed
and started again when a call outlives its deadline, and the other episodes' environments rebuilt in the new
host by replaying what they were asked (their reset and calls, in order: an environment is expected to answer
the same calls the same way).

Every failure is an ``Outcome`` with a kind the episode log shows (``raised``, ``unknown_tool``,
``bad_arguments``, ``result_too_long``, ``tool_timeout``, ``host_failed``), never an exception out of a step.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import subprocess
import sys
import time
from dataclasses import dataclass

from ladle.agents.environments import Environment

START_S = 60.0  # how long the host may take to start and load the environment's module
CHARS_PER_TOKEN = 32  # the host refuses a result over max_tool_result_tokens x this many characters


@dataclass
class Outcome:
    ok: bool
    value: str | None = None
    kind: str = ""  # why it failed
    error: str = ""
    seconds: float = 0.0


class HostError(RuntimeError):
    """The tool host could not start or load the environment: the run stops with the reason."""


class ToolHost:
    """One tool host subprocess and the episodes it holds. Use as a context manager, or ``close()``."""

    def __init__(self, env: Environment, timeout_s: float, max_result_tokens: int) -> None:
        self.env, self.timeout_s = env, timeout_s
        self.max_chars = max_result_tokens * CHARS_PER_TOKEN
        self.proc: subprocess.Popen | None = None
        self.replies = None
        self.buffer = b""
        self.history: dict[int, list[dict]] = {}  # each live episode's requests, to replay after a restart
        self.restarts = 0
        self.start()

    def __enter__(self) -> ToolHost:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        read_fd, write_fd = os.pipe()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ladle.agents.host", "--reply-fd", str(write_fd)],
            stdin=subprocess.PIPE,
            pass_fds=(write_fd,),
            start_new_session=True,  # a kill takes whatever the tool started with it
            env=env,
        )
        os.close(write_fd)
        self.replies, self.buffer = os.fdopen(read_fd, "rb", buffering=0), b""
        loaded = self.ask(
            {"op": "load", "target": self.env.target, "source": self.env.source, "max_chars": self.max_chars}, START_S
        )
        if not loaded.ok:
            self.close()
            raise HostError(
                f"training.rl.environment = {self.env.entry!r}: the tool host could not load it: {loaded.error}"
            )

    def close(self) -> None:
        """Kill the host (its whole session) and wait for it."""
        proc, self.proc = self.proc, None
        if proc is not None:  # its session, even where the host has exited: what its tools started goes too
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, 9)
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
            if proc.stdin:
                with contextlib.suppress(OSError):
                    proc.stdin.close()
        if self.replies is not None:
            self.replies.close()
            self.replies = None

    def ask(self, request: dict, timeout_s: float) -> Outcome:
        """Send one request and wait for its answer until ``timeout_s``; past it the host is killed
        (``tool_timeout``), and a host that died or answered garbage is ``host_failed``."""
        began = time.monotonic()
        try:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
        except (OSError, ValueError) as exc:
            return self.failed("host_failed", f"the tool host is gone ({exc})", began)
        deadline = began + timeout_s
        limit = self.max_chars * 6 + 4096  # JSON escapes a character in at most 6
        with selectors.DefaultSelector() as sel:
            sel.register(self.replies, selectors.EVENT_READ)
            while b"\n" not in self.buffer:
                left = deadline - time.monotonic()
                if left <= 0:
                    return self.failed("tool_timeout", f"no answer within {timeout_s:g} s", began)
                if not sel.select(left):
                    continue
                chunk = self.replies.read(65536)
                if not chunk:
                    return self.failed("host_failed", f"the tool host exited ({self.proc.poll()})", began)
                self.buffer += chunk
                if len(self.buffer) > limit:
                    return self.failed("host_failed", "the tool host's answer is over its cap", began)
        line, self.buffer = self.buffer.split(b"\n", 1)
        try:
            answer = json.loads(line)
        except ValueError:
            return self.failed("host_failed", "the tool host's answer is not JSON", began)
        seconds = time.monotonic() - began
        if answer.get("ok"):
            return Outcome(True, answer.get("value"), seconds=seconds)
        return Outcome(False, kind=str(answer.get("kind")), error=str(answer.get("error")), seconds=seconds)

    def failed(self, kind: str, error: str, began: float) -> Outcome:
        """The host is killed and started again; the episodes it held are replayed into the new one (those whose
        replay fails are dropped: their next call answers ``host_failed``)."""
        self.close()
        self.restarts += 1
        self.start()
        for episode, requests in list(self.history.items()):
            for request in requests:
                if not self.ask(request, self.timeout_s).ok:
                    self.history.pop(episode, None)
                    break
        return Outcome(False, kind=kind, error=error, seconds=time.monotonic() - began)

    def reset(self, episode: int, columns: dict) -> Outcome:
        request = {"op": "reset", "episode": episode, "columns": columns}
        self.history.pop(episode, None)
        out = self.ask(request, self.timeout_s)
        if out.ok:
            self.history[episode] = [request]
        return out

    def call(self, episode: int, name: str, arguments) -> Outcome:
        if episode not in self.history:
            return Outcome(False, kind="host_failed", error="its environment was lost with a killed tool host")
        request = {"op": "call", "episode": episode, "name": name, "arguments": arguments}
        kept = self.history.pop(episode)  # while it runs: a call that kills the host is not replayed
        out = self.ask(request, self.timeout_s)
        if out.kind not in ("tool_timeout", "host_failed"):  # answered (even with an error): the host still holds it
            self.history[episode] = [*kept, request]
        return out

    def step(self, episode: int, action: str) -> Outcome:
        """A gym-style environment's step on a turn's text: ``value`` is ``{"observation", "reward", "done"}``."""
        if episode not in self.history:
            return Outcome(False, kind="host_failed", error="its environment was lost with a killed tool host")
        request = {"op": "step", "episode": episode, "action": action}
        kept = self.history.pop(episode)
        out = self.ask(request, self.timeout_s)
        if out.kind not in ("tool_timeout", "host_failed"):
            self.history[episode] = [*kept, request]
        return out

    def drop(self, episode: int) -> None:
        if self.history.pop(episode, None) is not None:
            self.ask({"op": "drop", "episode": episode}, self.timeout_s)
