"""The tool host: a subprocess that holds each episode's environment and runs its tool calls, so a tool that
raises, hangs, prints or returns something huge cannot reach the training process.

``python -m ladle.agents.host`` reads one JSON request per line on stdin and answers one JSON line each on the
file descriptor it was given (``--reply-fd``, a pipe of its own: a tool's ``print`` goes to stderr, never into
the answers):

- ``{"op": "load", "target": ..., "source": ..., "max_chars": N}``: the class to instantiate per episode.
- ``{"op": "reset", "episode": K, "columns": {...}}``: a new instance for episode K, its ``reset(**columns)``
  called where it has one; answers the text it returned (or null).
- ``{"op": "call", "episode": K, "name": ..., "arguments": {...}}``: the tool's result as text (``str()`` of what
  it returned); a result over ``max_chars`` characters is refused, never cut.
- ``{"op": "step", "episode": K, "action": TEXT}``: a gym-style environment's ``step``; answers
  ``{"observation", "reward", "done"}`` from what it returned (an observation alone; a tuple; a dict).
- ``{"op": "drop", "episode": K}``: the episode is over.

An answer is ``{"ok": true, "value": ...}`` or ``{"ok": false, "kind": ..., "error": ...}`` with kind one of
``raised``, ``unknown_tool``, ``bad_arguments``, ``result_too_long``. Deadlines are the parent's
(``ladle.agents.tool_host``): a call past its deadline is answered by killing this process. The host ends when
its parent does, with whatever its tools started (on Linux the parent-death signal, also inside a tool that never
returns).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import inspect
import json
import os
import signal
import sys
import threading
import time

from ladle.agents.environments import NOT_TOOLS, load_class


def die_with_parent() -> None:
    """When the parent dies, kill this process's whole group: this host and whatever its code started (the host
    leads a session of its own). The parent-death signal (Linux) runs that at once, also inside a hung tool, and a
    watcher thread does it where the signal is not available."""
    parent = os.getppid()

    def end(*_) -> None:
        with contextlib.suppress(OSError):
            os.killpg(os.getpgid(0), signal.SIGKILL)
        os._exit(1)

    signal.signal(signal.SIGTERM, end)
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before the signal was asked for
        end()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        end()

    threading.Thread(target=watch, daemon=True).start()


class Host:
    def __init__(self) -> None:
        self.cls = None
        self.max_chars = 0
        self.episodes: dict[int, object] = {}

    def handle(self, request: dict) -> dict:
        op = request.get("op")
        if op == "load":
            self.cls = load_class(request["target"], request.get("source"), request["target"])
            self.max_chars = int(request["max_chars"])
            return {"ok": True, "value": None}
        if op == "drop":
            self.episodes.pop(request["episode"], None)
            return {"ok": True, "value": None}
        if op == "reset":
            env = self.cls()
            self.episodes[request["episode"]] = env
            reset = getattr(env, "reset", None)
            if not callable(reset):
                return {"ok": True, "value": None}
            return self.text_of(reset(**self.accepted(reset, request.get("columns") or {})), "reset")
        if op == "step":
            return self.step(self.episodes[request["episode"]], str(request.get("action", "")))
        if op == "call":
            return self.call(self.episodes[request["episode"]], request["name"], request.get("arguments"))
        return {"ok": False, "kind": "raised", "error": f"unknown op {op!r}"}

    @staticmethod
    def accepted(fn, columns: dict) -> dict:
        """The columns ``reset`` takes (all of them where it takes ``**kwargs``)."""
        params = inspect.signature(fn).parameters
        if any(p.kind is p.VAR_KEYWORD for p in params.values()):
            return columns
        return {k: v for k, v in columns.items() if k in params}

    def call(self, env, name: str, arguments) -> dict:
        method = getattr(env, name, None) if isinstance(name, str) else None
        if name in NOT_TOOLS or not isinstance(name, str) or name.startswith("_") or not callable(method):
            return {"ok": False, "kind": "unknown_tool", "error": f"no tool named {name!r}"}
        if not isinstance(arguments, dict):
            return {"ok": False, "kind": "bad_arguments", "error": f"arguments are {type(arguments).__name__}"}
        try:
            inspect.signature(method).bind(**arguments)
        except TypeError as exc:
            return {"ok": False, "kind": "bad_arguments", "error": f"{name}: {exc}"}
        return self.text_of(method(**arguments), name)

    def step(self, env, action: str) -> dict:
        value = env.step(action)
        reward, done = None, False
        if isinstance(value, dict):
            value, reward, done = value.get("observation"), value.get("reward"), bool(value.get("done"))
        elif isinstance(value, tuple):
            value, reward, done = (*value, None, False)[:3]
            done = bool(done)
        if reward is not None:
            reward = float(reward)
        out = self.text_of("" if value is None else value, "step")
        if out["ok"]:
            out["value"] = {"observation": out["value"], "reward": reward, "done": done}
        return out

    def text_of(self, value, what: str) -> dict:
        if value is None and what == "reset":
            return {"ok": True, "value": None}
        text = value if isinstance(value, str) else str(value)
        if len(text) > self.max_chars:
            return {
                "ok": False,
                "kind": "result_too_long",
                "error": f"{what} returned {len(text):,} characters; at most {self.max_chars:,} are taken",
            }
        return {"ok": True, "value": text}


def start_process():
    """A host process's start: it dies with its parent, answers on the pipe it was given (``--reply-fd``, line
    buffered), and whatever its user code prints goes to stderr, never among the answers."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--reply-fd", type=int, required=True)
    args = parser.parse_args()
    die_with_parent()
    replies = os.fdopen(args.reply_fd, "w", buffering=1)
    sys.stdout = sys.stderr
    return replies


def main() -> None:
    replies = start_process()
    host = Host()
    for line in sys.stdin:
        try:
            request = json.loads(line)
            answer = host.handle(request)
        except Exception as exc:  # noqa: BLE001 - the environment's code: its failure is the episode's
            answer = {"ok": False, "kind": "raised", "error": f"{type(exc).__name__}: {exc}"}
        try:
            text = json.dumps(answer)
        except (TypeError, ValueError) as exc:
            text = json.dumps({"ok": False, "kind": "raised", "error": f"unserialisable: {exc}"})
        replies.write(text + "\n")


if __name__ == "__main__":
    main()
