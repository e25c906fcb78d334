"""Agent programs (``training.rl.environment`` naming a function): any agent written against the OpenAI SDK trains
unchanged. ladle serves the live policy at an OpenAI-compatible endpoint during training (``Endpoint``: HTTP on
127.0.0.1, in the training process), runs the program once per episode in its own process
(``ladle.agents.program_host``), and turns every call it makes into the episode's tokens.

**The calls are batched and recorded, token in, token out.** Each episode has its own base URL
(``/episodes/K/v1``). A request waits until every running program has sent its next one (or ``GATHER_S`` passed
since the first waited): then they all run as one batch of ladle's engine on the calling thread, on the live
weights. The first request's messages, rendered with its tools by the model's chat template, are the episode's
prompt ids. A later request must send the conversation back as it got it, plus what came since (tool results, user
turns): only those new messages are tokenised, as the template's block after the model's EOS (``suffix_ids``, the
same as an in-process environment's), and appended after the very ids the engine sampled; the engine resumes from
the keys and values it kept. The reply is parsed by the OpenAI server's own tool parser (the template's format).
The episode's ids, mask (1 on the model's tokens) and sampler log-probabilities are exactly what the in-process
environments give (``ladle.agents.episodes.Episode``), so the loss trains what the program's model said.

**What a program cannot do here, and why.** Each refusal is an HTTP 400 with OpenAI's envelope, its ``code`` the
episode's mark (``ended``), and ends the episode's training tokens where they were:

- rewrite the conversation (``history_rewritten``: a changed earlier message or tools, an assistant message the
  model did not write): the trained tokens must be the ones the model saw;
- go past ``training.rl.episode.max_turns`` (``max_turns``) or continue after a turn cut at the token budget
  (``length``), or send results over ``max_tool_result_tokens`` (``tool_result_too_long``), or a first request
  over ``data.seq_len`` tokens as rendered (``prompt_too_long``);
- change how tokens are drawn (``unsupported_parameter``: ``n`` > 1, ``stream``, ``logprobs``, ``stop``, penalties,
  ``logit_bias``, ``response_format``, a forced ``tool_choice``): the policy is sampled as ``training.rl`` says,
  so the log-probabilities trained are the sampler's. ``temperature``, ``top_p`` and ``seed`` are taken and set by
  training; ``max_tokens`` is capped at ``training.rl.max_completion_tokens``.

An episode whose program returns ends ``answer`` (its last turn called no tool) or ``returned``; one that raises
ends ``raised`` with the error; one still running at ``training.rl.episode.program_timeout_s`` is killed with its
process and ends ``program_timeout``; one that never called ends ``no_turns``. The program's return value, a
number or ``{"reward": x}``, is the episode's ``env_reward``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial

from ladle.agents.environments import Environment
from ladle.agents.episodes import (
    Episode,
    Settings,
    note_error,
    prompt_messages,
    render_ids,
    suffix_ids,
    tool_format,
    turn_job,
)
from ladle.serve.rows import Job
from ladle.serve.schema import ApiError, ChatRequest
from ladle.serve.tools import ToolError, openai_calls, template_messages

GATHER_S = 0.05  # how long a waiting request waits for the other programs' before the batch runs without them
START_S = 30.0  # how long the endpoint's server may take to listen
MODEL = "ladle-policy"  # the model name the programs are given (the endpoint serves one model, whatever is asked)
PROGRAM_ENDS = ("returned", "program_timeout", "history_rewritten", "no_turns")
REFUSED = {  # request fields that would change how tokens are drawn, and the value that leaves them alone
    "n": 1,
    "stream": False,
    "logprobs": False,
    "stop": [],
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "logit_bias": None,
    "response_format": None,
}


class Endpoint:
    """The live policy's OpenAI-compatible endpoint: a uvicorn server on a thread of the training process, on a
    port of its own on 127.0.0.1; requests go to ``inbox`` for the training thread (``run``) to answer. Use as a
    context manager, or ``close()``."""

    def __init__(self, wait_s: float) -> None:
        import uvicorn
        from fastapi import FastAPI, Request
        from fastapi.exceptions import RequestValidationError

        from ladle.serve.schema import validation_error

        self.inbox: queue.Queue = queue.Queue()
        self.spare: Programs | None = None  # the next batch's program host, started ahead
        app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)

        @app.exception_handler(ApiError)
        async def api_error(request: Request, exc: ApiError):
            return exc.response()

        @app.exception_handler(RequestValidationError)
        async def invalid(request: Request, exc: RequestValidationError):
            return validation_error(exc).response()

        @app.post("/episodes/{key}/v1/chat/completions")
        async def chat(key: int, body: ChatRequest):
            answer: Future = Future()
            self.inbox.put(("request", key, body, answer))
            try:
                out = await asyncio.wait_for(asyncio.wrap_future(answer), wait_s)
            except TimeoutError:
                raise ApiError(504, f"no answer within {wait_s:g} s", code="timeout", kind="server_error") from None
            if isinstance(out, ApiError):
                raise out
            return out

        @app.get("/episodes/{key}/v1/models")
        async def models(key: int):
            return {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "ladle"}]}

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", timeout_keep_alive=30)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [sock]}, name="ladle-agent-endpoint", daemon=True
        )
        self.thread.start()
        deadline = time.monotonic() + START_S
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                self.sock = sock
                self.close()
                raise RuntimeError(f"the agent programs' endpoint did not start within {START_S:g} s")
            time.sleep(0.01)
        self.sock = sock  # uvicorn serves on this very socket: closed after it stops

    def __enter__(self) -> Endpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def take_spare(self) -> Programs:
        """A program host for the next batch: the one started ahead, or a new one."""
        spare, self.spare = self.spare, None
        if spare is not None and spare.proc.poll() is None:
            return spare
        if spare is not None:
            spare.close()
        return Programs()

    def close(self) -> None:
        if self.spare is not None:
            self.spare.close()
            self.spare = None
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()
        self.answer_all(ApiError(503, "training is not serving this episode", code="episode_over"))

    def answer_all(self, error: ApiError) -> None:
        """Answer every request still queued (a program of an earlier batch, killed while it asked)."""
        while True:
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return
            if item[0] == "request" and not item[3].done():
                item[3].set_result(error)


class Programs:
    """One batch's program host: ``python -m ladle.agents.program_host``, started ahead of its batch (its imports
    done while the training step runs: ``Endpoint.spare``) and told the batch by ``begin``; its answers put in the
    endpoint's inbox as ``("ended", key, answer)`` by a reader thread."""

    def __init__(self) -> None:
        self.read_fd, write_fd = os.pipe()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ladle.agents.program_host", "--reply-fd", str(write_fd)],
            stdin=subprocess.PIPE,
            pass_fds=(write_fd,),
            start_new_session=True,  # a kill takes whatever the program started with it
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        os.close(write_fd)
        self.reader: threading.Thread | None = None

    def begin(self, env: Environment, endpoint: Endpoint, episodes: dict[int, Episode], timeout_s: float) -> None:
        request = {
            "target": env.target,
            "source": env.source,
            "base_url": endpoint.url,
            "model": MODEL,
            "timeout_s": timeout_s,
            "episodes": [
                {"key": key, "messages": e.prompt, "columns": dict(e.row.get("columns", {}))}
                for key, e in episodes.items()
            ],
        }
        replies = os.fdopen(self.read_fd, "rb")
        self.reader = threading.Thread(target=self.read, args=(replies, endpoint.inbox), daemon=True)
        self.reader.start()
        try:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.close()
        except OSError:  # it died before its batch: the reader reports it exited
            pass

    def read(self, replies, inbox: queue.Queue) -> None:
        with replies:
            for line in replies:
                try:
                    answer = json.loads(line)
                    inbox.put(("ended", int(answer["key"]), answer, None))
                except (ValueError, KeyError, TypeError):
                    continue
        inbox.put(("exited", -1, None, None))

    def close(self) -> None:
        """Kill the host's whole session (what the program started too, even after the host has exited) and wait
        for it and its reader."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, 9)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        if self.reader is not None:
            self.reader.join(timeout=10)
        else:
            with contextlib.suppress(OSError):
                os.close(self.read_fd)


def run(
    engine,
    tokenizer,
    endpoint: Endpoint,
    env: Environment,
    rows: list[dict],
    settings: Settings,
    seed: Callable[[int, int], int] | None,
    first: int = 0,
    timeout_s: float = 300.0,
) -> tuple[list[Episode], float]:
    """Play one episode per row with the agent program (``seed(k, turn)``: episode k's turn's seed; None:
    greedy), every waiting call in one batch of ``engine``. Returns the episodes and the seconds spent generating;
    the program's process is killed on the way out, whatever happened.

    Raises:
        RuntimeError: the engine failed a turn (the calls waiting on it are answered 503 first).
        TemplateError: the template cannot carry the new messages after the model's tokens.
    """
    episodes = {first + k: Episode(row, [], prompt_messages(row["prompt"], None)) for k, row in enumerate(rows)}
    endpoint.answer_all(ApiError(503, "training is not serving this episode", code="episode_over"))
    serving = Serving(engine, tokenizer, episodes, settings, seed, first)
    programs = endpoint.take_spare()
    programs.begin(env, endpoint, episodes, timeout_s)
    running, waiting = set(episodes), {}
    deadline, gathered_at = time.monotonic() + timeout_s, None
    exited = False
    try:
        while running:
            now = time.monotonic()
            if now >= deadline:
                break
            wait = deadline - now if not waiting else max(0.0, gathered_at + GATHER_S - now)
            try:
                kind, key, payload, answer = endpoint.inbox.get(timeout=wait)
            except queue.Empty:
                kind = None
            if kind == "request":
                if key not in running:
                    answer.set_result(ApiError(404, f"no episode {key} is running", code="episode_over"))
                elif key in waiting:  # a second call at once: an episode is one conversation, a call at a time
                    answer.set_result(
                        ApiError(
                            409,
                            f"episode {key} already has a call waiting: its calls are one conversation, one at a "
                            "time (send the next after the reply)",
                            code="call_in_flight",
                        )
                    )
                else:
                    waiting[key] = (payload, answer)
                    gathered_at = gathered_at or time.monotonic()
            elif kind == "ended":
                running.discard(key)
                serving.end(key, payload)
            elif kind == "exited":
                exited = True
            if waiting and (len(waiting) >= len(running) or time.monotonic() >= gathered_at + GATHER_S):
                serving.turn(waiting)
                waiting, gathered_at = {}, None
            if exited and running and not waiting:  # nothing more will come from a process that is gone
                break
        if running:
            cause = "program_timeout" if not exited else "raised"
            why = (
                f"still running after training.rl.episode.program_timeout_s = {timeout_s:g} s; killed"
                if not exited
                else "the program's process exited without ending this episode"
            )
            for key in running:
                serving.end(key, {"ok": False, "kind": cause, "error": why})
    finally:
        programs.close()
        endpoint.spare = Programs()  # the next batch's, its imports done while this step trains
        for _payload, answer in waiting.values():  # calls a failed turn or the deadline left unanswered
            if not answer.done():
                answer.set_result(ApiError(503, "training is not serving this episode", code="episode_over"))
        endpoint.answer_all(ApiError(503, "training is not serving this episode", code="episode_over"))
    for e in episodes.values():
        e.kv = None
        if not e.prompt_ids:  # it never called: its prompt as the row gives it, nothing after
            e.prompt_ids = render_ids(tokenizer, e.prompt, [], prompt=True)
    return list(episodes.values()), serving.generating


class Serving:
    """The episodes' side of the endpoint: requests turned into engine jobs and replies, every token recorded."""

    def __init__(self, engine, tokenizer, episodes: dict[int, Episode], settings: Settings, seed, first: int) -> None:
        self.engine, self.tokenizer, self.episodes = engine, tokenizer, episodes
        self.settings, self.seed, self.first = settings, seed, first
        self.generating = 0.0
        self.fmt = None

    def end(self, key: int, answer: dict) -> None:
        e = self.episodes[key]
        if answer.get("ok"):
            e.env_reward = answer.get("reward")
            if e.ended is None:
                last = e.messages[-1] if e.messages else None
                if e.turns == 0:
                    e.ended = "no_turns"
                elif last is not None and last["role"] == "assistant" and not last.get("tool_calls"):
                    e.ended = "answer"
                else:
                    e.ended = "returned"
        elif e.ended is None:
            e.ended, e.error = str(answer.get("kind", "raised")), str(answer.get("error", ""))

    def turn(self, waiting: dict[int, tuple[ChatRequest, Future]]) -> None:
        """One engine batch for every waiting request; each answered with its reply or its refusal. A failed
        engine raises; ``run`` answers the calls left on its way out."""
        jobs, failures = [], []
        on_event = partial(note_error, failures)
        for key, (req, answer) in waiting.items():
            e = self.episodes[key]
            try:
                ids = self.extend(e, req)
            except ApiError as refusal:
                answer.set_result(refusal)
                continue
            budget = self.settings.max_completion_tokens
            asked = min(req.max_completion_tokens or req.max_tokens or budget, budget)
            seed = self.seed(key - self.first, e.turns) if self.seed is not None else None
            jobs.append((key, turn_job(ids, self.settings, seed, e.turns, e.kv, on_event, asked), answer))
        if not jobs:
            return
        began = time.perf_counter()
        self.engine.run([job for _, job, _ in jobs])
        self.generating += time.perf_counter() - began
        if failures:
            raise RuntimeError(f"episode rollout failed: {failures[0]}")
        for key, job, answer in jobs:
            answer.set_result(self.reply(self.episodes[key], job))

    def refuse(self, e: Episode, code: str, message: str, param: str | None = None) -> ApiError:
        if code not in ("unsupported_parameter",):
            e.ended, e.error = e.ended or code, e.error or message
        return ApiError(400, message, param=param, code=code)

    def extend(self, e: Episode, req: ChatRequest) -> list[int]:
        """The ids the engine continues for ``req``: the episode's so far and the new messages' block after them
        (the first request: its prompt).

        Raises:
            ApiError: the request is refused (the module's list); the episode's mark is set where it ends it.
        """
        if e.ended is not None:
            raise ApiError(400, f"this episode has ended ({e.ended}): {e.error}".rstrip(": "), code=e.ended)
        for name, neutral in REFUSED.items():
            value = getattr(req, name)
            if value != neutral and not (name == "stop" and not value):  # stop: None or []
                raise self.refuse(
                    e,
                    "unsupported_parameter",
                    f"{name} is not served to an agent program during training: the policy is sampled as "
                    "training.rl says, so what is trained is what was drawn. Leave it out.",
                    name,
                )
        if req.tool_choice not in (None, "auto"):
            raise self.refuse(
                e,
                "unsupported_parameter",
                "only tool_choice auto is served during training: the model decides",
                "tool_choice",
            )
        if e.turns >= self.settings.max_turns:
            raise self.refuse(
                e, "max_turns", f"the episode has had its {e.turns} turns (training.rl.episode.max_turns)"
            )
        messages = template_messages(req.messages)
        tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
        if tools and self.fmt is None:
            try:
                self.fmt = tool_format(self.tokenizer)
            except ToolError as exc:
                raise self.refuse(
                    e, "raised", f"{exc}. Set chat_template to one that renders tools.", "tools"
                ) from None
        if e.turns == 0:
            ids = render_ids(self.tokenizer, messages, tools, prompt=True)
            if self.settings.prompt_error(ids):
                raise self.refuse(e, "prompt_too_long", self.settings.prompt_error(ids), "messages")
            e.prompt, e.tools, e.prompt_ids = messages, tools, ids
            return list(e.prompt_ids)
        new = self.new_messages(e, messages, tools)
        called = [c["function"]["name"] for c in e.messages[-1].get("tool_calls") or ()]
        block = suffix_ids(self.tokenizer, tools, new, called or None)
        if len(block) > self.settings.max_tool_result_tokens:
            raise self.refuse(
                e,
                "tool_result_too_long",
                f"the new messages take {len(block)} tokens; training.rl.episode.max_tool_result_tokens is "
                f"{self.settings.max_tool_result_tokens}",
            )
        e.messages += new
        e.ids += block
        e.mask += [0] * len(block)
        e.logps += [0.0] * len(block)
        return e.prompt_ids + e.ids

    def new_messages(self, e: Episode, messages: list[dict], tools: list[dict]) -> list[dict]:
        """What ``messages`` adds to the episode's conversation.

        Raises:
            ApiError: it does not extend it (``history_rewritten``, naming what differs).
        """
        if tools != e.tools:
            raise self.refuse(e, "history_rewritten", "the tools differ from the episode's first request's", "tools")
        sent = e.prompt + e.messages
        for i, (got, had) in enumerate(zip(messages, sent, strict=False)):
            if shape(got) != shape(had):
                raise self.refuse(
                    e,
                    "history_rewritten",
                    f"messages[{i}] ({got['role']}) differs from the conversation so far: send it back as it was "
                    "given (the trained tokens must be the ones the model saw), and add only what came since",
                    f"messages[{i}]",
                )
        new = messages[len(sent) :]
        if not new:
            raise self.refuse(e, "history_rewritten", "no message after the model's last reply", "messages")
        if any(m["role"] == "assistant" for m in new):
            raise self.refuse(
                e,
                "history_rewritten",
                "an assistant message the model did not write (only the model's replies are assistant turns)",
                "messages",
            )
        return new

    def reply(self, e: Episode, job: Job) -> dict:
        """The turn recorded in the episode and its OpenAI response: content and calls by the server's parser."""
        chosen = (
            list(job.chosen)
            if job.sampled is not None
            else job.tokens + ([job.stop_token] if job.stop_token is not None else [])
        )
        start = len(e.ids)
        e.ids += chosen
        e.mask += [1] * len(chosen)
        e.logps += list(job.sampled) if job.sampled is not None else [0.0] * len(chosen)
        e.kv, job.kv_out = job.kv_out, None
        e.turns += 1
        text = self.tokenizer.decode(job.tokens, skip_special_tokens=False)
        calls = []
        content = text
        if job.finish == "length":
            e.ended, e.error = (
                "length",
                f"the turn reached {job.max_new_tokens} tokens (training.rl.max_completion_tokens)",
            )
            finish = "length"
        elif e.tools and self.fmt is not None:
            content, calls = self.fmt.parse(text)
            finish = "tool_calls" if calls else "stop"
        else:
            finish = "stop"
        tool_calls = openai_calls(calls) if calls else None
        e.calls += len(calls)
        e.messages.append(
            {"role": "assistant", "content": content or "", **({"tool_calls": tool_calls} if calls else {})}
        )
        e.requests.append(
            {
                "turn": e.turns,
                "at": start,
                "prompt_tokens": len(job.ids),
                "completion_tokens": len(chosen),
                "finish_reason": finish,
            }
        )
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": MODEL,
            "choices": [
                {
                    "index": 0,
                    "message": {
                        "role": "assistant",
                        "content": content if content or not calls else None,
                        "tool_calls": tool_calls,
                    },
                    "finish_reason": finish,
                    "logprobs": None,
                }
            ],
            "usage": {
                "prompt_tokens": len(job.ids),
                "completion_tokens": len(job.tokens),
                "total_tokens": len(job.ids) + len(job.tokens),
            },
        }


def shape(message: dict) -> tuple:
    """What must match for a message sent back to be the one the episode holds: its role, its content, and its
    calls' names and arguments (their ids are the client's to keep)."""
    calls = tuple(
        (c["function"]["name"], json.dumps(args_of(c["function"]["arguments"]), sort_keys=True))
        for c in message.get("tool_calls") or ()
    )
    return message["role"], message.get("content") or "", calls


def args_of(arguments):
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments
