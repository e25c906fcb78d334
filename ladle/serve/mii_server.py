"""DeepSpeed-MII's model server with its streamed text made exact: ``python -m ladle.serve.mii_server ARGS`` is
``python -m mii.launch.multi_gpu_server ARGS`` with ladle's detokenizer in place of MII's ``ReadableStream``.

Why: MII 0.3.3 turns each streamed token into text by decoding the request's held tokens and holding them back
while the text *contains* U+FFFD (an incomplete UTF-8 sequence). A token that is, and stays, an invalid byte
sequence (byte-fallback tokens from sampling, or any model's rare byte token) therefore holds back every later
token: the rest of the answer is lost, streamed and whole alike (ladle asks MII for streams). On an H200 a
random-weight Llama served through ladle answered " the the the" where transformers' ``generate`` and
``mii.pipeline`` gave " the the the\\ufffd the\\ufffd the the ..." (bench/RESULTS.md). Held-back text at the end
of an answer was dropped too, and a stream ended early left its tokens to the next request of the same thread.

Here each stream keeps a prefix window (as incremental detokenizers in inference servers do): the text of the
tokens after the window's start, less the window's own text, is emitted once it does not *end* in U+FFFD; the
end of the stream emits what is still held; a new request on a thread starts a fresh stream. The streamed
pieces then join to exactly ``tokenizer.decode`` of the answer's tokens (tests/serve/test_mii_stream.py).

ladle's front starts MII through ``mii.serve``; :func:`route_server_processes` makes the processes MII launches
run this module instead of MII's own (everything else on their command line unchanged).
"""

from __future__ import annotations

import runpy
import subprocess
import threading
import types
from collections.abc import Callable

MII_SERVER = "mii.launch.multi_gpu_server"
THIS = "ladle.serve.mii_server"
REPLACEMENT = "\ufffd"


class StreamText:
    """One stream's text, token by token: :meth:`push` returns the new text that is complete, :meth:`finish`
    whatever is still held. Joined, the pieces equal ``decode(all ids)``."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode, self.ids, self.prefix, self.read = decode, [], 0, 0

    def push(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        new = self.held()
        if not new or new.endswith(REPLACEMENT):
            return ""  # nothing new yet, or an incomplete character: wait for the next token
        self.prefix, self.read = self.read, len(self.ids)
        return new

    def finish(self) -> str:
        new = self.held()
        self.prefix = self.read = len(self.ids)
        return new

    def held(self) -> str:
        """The text of the tokens not yet sent: the window's text with its already-sent start taken off."""
        sent = self.decode(self.ids[self.prefix : self.read])
        return self.decode(self.ids[self.prefix :])[len(sent) :]


class ReadableStream:
    """MII's ``ReadableStream`` interface (``decode(thread_id, token_ids)``, ``flush_state(thread_id)``) over
    :class:`StreamText`, one stream per request thread as MII keys them. What :meth:`flush_state` finds still
    held goes to ``tails``, for the final response of that thread's request."""

    replaces: type | None = None
    """MII's own class, once :func:`install` has put this one in its place."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.streams: dict[int, StreamText] = {}
        self.tails: dict[int, str] = {}

    def decode(self, thread_id: int, token_ids) -> str:
        stream = self.streams.get(thread_id)
        if stream is None:
            stream = self.streams[thread_id] = StreamText(self.tokenizer.decode)
        return stream.push([int(t) for t in token_ids])

    def flush_state(self, thread_id: int) -> None:
        stream = self.streams.pop(thread_id, None)
        tail = stream.finish() if stream is not None else ""
        if tail:
            self.tails[thread_id] = tail

    def reset(self, thread_id: int) -> None:
        """A new request on ``thread_id``: whatever an earlier one left (a stream ended early) is dropped."""
        self.streams.pop(thread_id, None)
        self.tails.pop(thread_id, None)


def install() -> None:
    """Put :class:`ReadableStream` into MII's async pipeline (before it is built), with the final response of a
    stream carrying the held tail and each request starting a fresh stream.

    Raises:
        RuntimeError: the installed MII lacks what this replaces (ladle's mii extra pins deepspeed-mii 0.3.3).
    """
    from mii.batching import ragged_batching

    pipeline = getattr(ragged_batching, "MIIAsyncPipeline", None)
    missing = [
        name
        for name, there in [
            ("ReadableStream", hasattr(ragged_batching, "ReadableStream")),
            ("MIIAsyncPipeline.get_response", hasattr(pipeline, "get_response")),
            ("MIIAsyncPipeline.put_request", hasattr(pipeline, "put_request")),
        ]
        if not there
    ]
    if missing:
        raise RuntimeError(
            f"ladle's MII server: the installed deepspeed-mii has no {', '.join(missing)}; ladle's mii extra "
            "pins deepspeed-mii==0.3.3 (pip install 'ladle[mii]')."
        )
    if getattr(pipeline.get_response, "ladle", False):
        return
    ReadableStream.replaces = ragged_batching.ReadableStream
    ragged_batching.ReadableStream = ReadableStream
    get_response, put_request = pipeline.get_response, pipeline.put_request

    def put_request_fresh(self, prompt, kwargs):
        if isinstance(self.readable_stream, ReadableStream):
            self.readable_stream.reset(threading.get_ident())
        return put_request(self, prompt, kwargs)

    def get_response_with_tail(self):
        uid, response = get_response(self)
        if isinstance(self.readable_stream, ReadableStream):
            tail = self.readable_stream.tails.pop(threading.get_ident(), "")
            if tail:
                response.generated_text = tail + response.generated_text
        return uid, response

    get_response_with_tail.ladle = True
    pipeline.put_request, pipeline.get_response = put_request_fresh, get_response_with_tail


def server_command(cmd: list[str]) -> list[str]:
    """MII's server command with this module in place of MII's own.

    Raises:
        RuntimeError: the command does not run MII's server module (another MII version).
    """
    for i in range(len(cmd) - 1):
        if cmd[i] == "-m" and cmd[i + 1] == MII_SERVER:
            return [*cmd[: i + 1], THIS, *cmd[i + 2 :]]
    raise RuntimeError(
        f"ladle's MII server: MII launched {' '.join(cmd[:8])} ..., not -m {MII_SERVER}; ladle's mii extra pins "
        "deepspeed-mii==0.3.3 (pip install 'ladle[mii]')."
    )


def route_server_processes() -> None:
    """Make ``mii.serve`` (in this process) launch its processes through this module."""
    from mii.backend import server

    if getattr(server.subprocess, "ladle", False):
        return
    shim = types.ModuleType("subprocess")
    shim.__dict__.update(vars(subprocess))
    shim.Popen = lambda cmd, *args, **kwargs: subprocess.Popen(server_command(list(cmd)), *args, **kwargs)
    shim.ladle = True
    server.subprocess = shim


def main() -> None:
    install()
    runpy.run_module(MII_SERVER, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
