"""The program host: a subprocess that runs an agent program (``training.rl.environment`` naming a function) for
each episode of a batch, all at once, each with an OpenAI client pointed at its episode's endpoint
(``ladle.agents.programs``). The program's own code and tools run here, never in the training process.

``python -m ladle.agents.program_host --reply-fd N`` starts ahead of its batch (the OpenAI client imported) and
reads one JSON request on stdin::

    {"target": ..., "source": ..., "base_url": "http://127.0.0.1:PORT", "model": ..., "timeout_s": S,
     "episodes": [{"key": K, "messages": [...], "columns": {...}}, ...]}

and answers one JSON line per episode, as each ends, on its own pipe (a program's ``print`` goes to stderr):
``{"key": K, "ok": true, "reward": float | null}`` or ``{"key": K, "ok": false, "kind": "raised", "error": ...}``.
Episode K's client talks to ``{base_url}/episodes/K/v1``. A plain function runs on a thread of its own with an
``openai.OpenAI``, an ``async`` one as a task with an ``openai.AsyncOpenAI``; neither retries (a refusal is the
episode's end, not something to try again). The host exits when every episode has answered, and dies with its
parent (``host.die_with_parent``); the parent's deadline kills it otherwise.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

from ladle.agents.environments import load_object
from ladle.agents.host import Host, start_process

API_KEY = "ladle-training"  # the endpoint checks none; the SDK wants one


def reward_of(value) -> float | None:
    """What a program returned as its reward: a number, ``{"reward": x}``, or None."""
    if isinstance(value, dict):
        value = value.get("reward")
    if value is None:
        return None
    return float(value)


def answer(key: int, fn) -> dict:
    try:
        return {"key": key, "ok": True, "reward": reward_of(fn())}
    except Exception as exc:  # noqa: BLE001 - the program's failure is its episode's
        return {"key": key, "ok": False, "kind": "raised", "error": f"{type(exc).__name__}: {exc}"[:2000]}


async def answer_async(key: int, make) -> dict:
    try:
        return {"key": key, "ok": True, "reward": reward_of(await make())}
    except Exception as exc:  # noqa: BLE001 - as above
        return {"key": key, "ok": False, "kind": "raised", "error": f"{type(exc).__name__}: {exc}"[:2000]}


def run(request: dict, reply) -> None:
    import openai

    program = load_object(request["target"], request.get("source"), request["target"])
    lock = threading.Lock()

    def send(out: dict) -> None:
        with lock:
            reply.write(json.dumps(out) + "\n")

    def url(key: int) -> str:
        return f"{request['base_url']}/episodes/{key}/v1"

    episodes, model, timeout = request["episodes"], request["model"], float(request["timeout_s"])
    if inspect.iscoroutinefunction(program):

        async def main() -> None:
            async def one(ep: dict) -> None:
                client = openai.AsyncOpenAI(base_url=url(ep["key"]), api_key=API_KEY, max_retries=0, timeout=timeout)
                columns = Host.accepted(program, ep["columns"])
                send(await answer_async(ep["key"], lambda: program(client, model, ep["messages"], **columns)))
                await client.close()

            await asyncio.gather(*(one(ep) for ep in episodes))

        asyncio.run(main())
        return

    def one(ep: dict) -> None:
        with openai.OpenAI(base_url=url(ep["key"]), api_key=API_KEY, max_retries=0, timeout=timeout) as client:
            columns = Host.accepted(program, ep["columns"])
            send(answer(ep["key"], lambda: program(client, model, ep["messages"], **columns)))

    with ThreadPoolExecutor(max_workers=max(len(episodes), 1)) as pool:
        list(pool.map(one, episodes))


def main() -> None:
    reply = start_process()
    import openai  # noqa: F401 - started ahead of its batch: the client's imports done while training steps

    line = sys.stdin.readline()
    if not line:  # never given a batch (training ended)
        return
    request = json.loads(line)
    try:
        run(request, reply)
    except Exception as exc:  # noqa: BLE001 - the program could not even load: every episode says why
        for ep in request["episodes"]:
            reply.write(json.dumps({"key": ep["key"], "ok": False, "kind": "raised", "error": f"{exc}"}) + "\n")


if __name__ == "__main__":
    main()
