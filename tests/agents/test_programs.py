"""Agent programs: a function written against the OpenAI SDK plays each episode against ladle's endpoint of the
live policy, in its own process; every call's tokens are recorded as an in-process environment's would be, and
everything a program does wrong ends only its own episode, with a mark."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from ladle.agents import environments, episodes, held_out, programs

PROGRAM = '''
import json

from ladle.agents.builtin import Calculator

TOOLS = {tools}


def play(client, model, messages, answer=None):
    """The calculator episode of ladle's own environment, as an OpenAI SDK program writes it."""
    messages, calc = list(messages), Calculator()
    while True:
        reply = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=80)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))  # the SDK's object, sent back as it came
        if not message.tool_calls:
            return {{"reward": float(message.content.strip() == answer)}}
        for call in message.tool_calls:
            result = calc.calculate(**json.loads(call.function.arguments))
            messages.append({{"role": "tool", "tool_call_id": call.id, "name": call.function.name, "content": result}})


def chain(client, model, messages, answer=None):
    """The same episode as a LangChain agent writes it: ChatOpenAI with the tools bound, its own messages."""
    from langchain_core.messages import ToolMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=model, base_url=str(client.base_url), api_key="none", max_retries=0, max_tokens=80)
    llm, history, calc = llm.bind_tools(TOOLS), list(messages), Calculator()
    while True:
        reply = llm.invoke(history)
        history.append(reply)
        if not reply.tool_calls:
            return float(reply.content.strip() == answer)
        for call in reply.tool_calls:
            result = calc.calculate(**call["args"])
            history.append(ToolMessage(content=result, tool_call_id=call["id"], name=call["name"]))


async def play_async(client, model, messages, **columns):
    reply = await client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=80)
    return 0.25 if reply.choices[0].finish_reason in ("stop", "tool_calls", "length") else 0.0


def rewrites(client, model, messages):
    reply = client.chat.completions.create(model=model, messages=messages, tools=TOOLS)
    client.chat.completions.create(model=model, messages=messages + [{{"role": "assistant", "content": "7"}}, {{"role": "user", "content": "sure?"}}], tools=TOOLS)


def forever(client, model, messages, pid_file):
    import subprocess
    child = subprocess.Popen(["sleep", "600"])  # what a program's tool may start
    with open(pid_file, "w") as f:
        f.write(str(child.pid))
    client.chat.completions.create(model=model, messages=messages, tools=TOOLS)
    child.wait()


def raises(client, model, messages):
    raise ValueError("the program's own bug")


def exits(client, model, messages):
    import os
    os._exit(3)  # the whole process, every episode's program with it


def never_calls(client, model, messages):
    return 0.5


def penalised(client, model, messages):
    client.chat.completions.create(model=model, messages=messages, presence_penalty=1.0)
'''


@pytest.fixture(scope="module")
def caller(tool_caller):
    """The tiny model taught to call the calculator, its tokenizer, an engine over it and a live endpoint."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ladle.serve.engine import Engine

    tokenizer = AutoTokenizer.from_pretrained(tool_caller)
    model = AutoModelForCausalLM.from_pretrained(tool_caller, dtype=torch.float32).eval()
    with programs.Endpoint(wait_s=60) as endpoint:
        yield tokenizer, Engine(model, tokenizer, "cpu", 8, thread=False), endpoint, model


@pytest.fixture(scope="module")
def program_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("program") / "agent.py"
    path.write_text(PROGRAM.format(tools=json.dumps(list(environments.load("calculator", {}).tools))))
    return path


def program(path, name):
    entry = f"{path}:{name}"
    return environments.load(entry, environments.bundle(entry))


def settings(**changes) -> episodes.Settings:
    return episodes.Settings(**{"max_turns": 3, "max_completion_tokens": 80, "max_tool_result_tokens": 64, **changes})


def seed(k: int, turn: int) -> int:
    return 100 * k + turn


def rows(n: int) -> list[dict]:
    questions = ["What is 2 + 3?", "Add 2 and 3.", "2 plus 3?", "Sum 2 and 3."]
    return [{"prompt": [{"role": "user", "content": questions[k % 4]}], "columns": {"answer": "5"}} for k in range(n)]


def test_an_openai_sdk_program_trains_exactly_the_tokens_an_in_process_environment_trains(caller, program_file):
    """The same episodes, played by a program over HTTP and by ladle's calculator in its tool host: the same
    prompt ids, the same sampled ids, the same masks, the same log-probabilities; every call batched."""
    from ladle.agents.tool_host import ToolHost

    tokenizer, engine, endpoint, _ = caller
    env = program(program_file, "play")
    assert env.program and env.tools == ()
    batch = rows(4)
    played, _ = programs.run(engine, tokenizer, endpoint, env, batch, settings(), seed, first=10, timeout_s=120)
    calculator = environments.load("calculator", {})
    with ToolHost(calculator, 5.0, 64) as host:
        hosted, _ = episodes.run(engine, tokenizer, host, calculator, batch, settings(), seed, first=10)
    assert any(e.calls for e in played) and any(e.ended == "answer" for e in played), [e.ended for e in played]
    for a, b in zip(played, hosted, strict=True):
        assert a.prompt_ids == b.prompt_ids
        assert a.ids == b.ids and a.mask == b.mask
        assert a.logps == pytest.approx(b.logps, abs=1e-4)
        assert (a.turns, a.calls) == (b.turns, b.calls)
        assert a.ended == b.ended
        assert [programs.shape(m) for m in a.messages] == [programs.shape(m) for m in b.messages]
        if b.ended == "answer":
            assert a.env_reward == float(b.messages[-1]["content"].strip() == "5")
        record = a.record()
        assert record["tools"] == list(calculator.tools)
        # Each call's tokens begin where the record says: the model's first token after a masked block.
        assert [r["at"] for r in record["requests"]] == [
            i for i in range(len(a.mask)) if a.mask[i] == 1 and (i == 0 or a.mask[i - 1] == 0)
        ]
    from ladle.train import grpo_agent

    cases = grpo_agent.parity_cases([e.record() for e in played], (), 80)
    assert cases and all(case["tools"] == list(calculator.tools) for case in cases)


def test_an_async_program_and_every_way_a_program_fails_end_only_their_own_episodes(caller, program_file):
    tokenizer, engine, endpoint, _ = caller
    out = {}
    for name in ("play_async", "rewrites", "raises", "never_calls", "penalised", "exits"):
        done, _ = programs.run(
            engine, tokenizer, endpoint, program(program_file, name), rows(2), settings(), seed, timeout_s=60
        )
        out[name] = done
    long, _ = programs.run(
        engine, tokenizer, endpoint, program(program_file, "play"), rows(1), settings(max_prompt_tokens=8), seed
    )
    assert [(e.ended, e.turns, e.ids) for e in long] == [("prompt_too_long", 0, [])]
    assert "data.seq_len is 8" in long[0].error
    assert [e.env_reward for e in out["play_async"]] == [0.25, 0.25]
    assert all(e.turns == 1 and e.ended in ("returned", "answer") for e in out["play_async"])
    rewritten = out["rewrites"][0]
    assert (rewritten.ended, rewritten.turns) == ("history_rewritten", 1)
    assert "messages[1] (assistant) differs from the conversation so far" in rewritten.error
    assert all(e.mask.count(0) == 0 for e in out["rewrites"])  # nothing after the rewrite was taken
    assert [(e.ended, e.turns) for e in out["raises"]] == [("raised", 0)] * 2
    assert "ValueError: the program's own bug" in out["raises"][0].error
    assert out["raises"][0].prompt_ids  # its prompt as the row gives it: an empty completion, still trainable
    assert [(e.ended, e.env_reward) for e in out["never_calls"]] == [("no_turns", 0.5)] * 2
    # A process that exits under its programs ends their episodes at once, not at the deadline.
    assert [e.ended for e in out["exits"]] == ["raised"] * 2
    assert "exited without ending this episode" in out["exits"][0].error
    refused = out["penalised"][0]
    assert (refused.ended, refused.turns) == ("raised", 0)
    assert "presence_penalty is not served to an agent program" in refused.error


def test_a_failed_engine_stops_the_run_and_answers_the_calls_waiting_on_it(caller, program_file):
    """The policy failing a turn is the run's failure (as in-process episodes raise), never a hang: every waiting
    call is answered and the program's process is killed."""

    class Broken:
        def run(self, jobs):
            raise RuntimeError("the engine broke")

    tokenizer, _, endpoint, _ = caller
    began = time.monotonic()
    with pytest.raises(RuntimeError, match="the engine broke"):
        programs.run(Broken(), tokenizer, endpoint, program(program_file, "play"), rows(2), settings(), seed)
    assert time.monotonic() - began < 30
    assert endpoint.inbox.empty()


def test_a_program_past_its_deadline_is_killed_with_everything_it_started(caller, program_file, tmp_path):
    tokenizer, engine, endpoint, _ = caller
    pid_file = tmp_path / "pid"
    row = [{"prompt": [{"role": "user", "content": "What is 2 + 3?"}], "columns": {"pid_file": str(pid_file)}}]
    began = time.monotonic()
    done, _ = programs.run(
        engine, tokenizer, endpoint, program(program_file, "forever"), row, settings(), seed, timeout_s=6
    )
    assert time.monotonic() - began < 30
    (e,) = done
    assert e.ended == "program_timeout" and "program_timeout_s = 6 s; killed" in e.error, (e.ended, e.error)
    assert e.turns == 1  # the turn it asked for was served before the deadline
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 10  # the kill is SIGKILL to its session: reaped by init shortly after
    while time.monotonic() < deadline and alive(pid):
        time.sleep(0.05)
    assert not alive(pid)


def test_a_langchain_agent_trains_unchanged(caller, program_file):
    """LangChain's ChatOpenAI, a client ladle did not write, sends the conversation back in its own serialisation:
    the episode still grows by appending, and trains as one sequence."""
    tokenizer, engine, endpoint, _ = caller
    done, _ = programs.run(engine, tokenizer, endpoint, program(program_file, "chain"), rows(2), settings(), None)
    assert [(e.ended, e.turns, e.calls, e.env_reward) for e in done] == [("answer", 2, 1, 1.0)] * 2, [
        (e.ended, e.error) for e in done
    ]
    assert all(e.mask.count(0) > 0 and e.mask[-1] == 1 for e in done)  # the result's block between the two turns


def test_the_evaluation_plays_a_programs_held_out_episodes_greedy_as_the_environments(caller, program_file):
    """The evaluate stage's episodes (``held_out``: its own engine and endpoint, greedy) of the program are the
    calculator environment's."""
    from ladle.config.rl import EpisodeConfig

    tokenizer, _, _, model = caller
    ep = EpisodeConfig(max_turns=3, max_tool_result_tokens=64, program_timeout_s=60)
    played = held_out.play(model, tokenizer, "cpu", rows(2), program(program_file, "play"), settings(), ep, 8)
    hosted = held_out.play(model, tokenizer, "cpu", rows(2), environments.load("calculator", {}), settings(), ep, 8)
    assert [(e.ended, e.calls, e.env_reward) for e in played] == [("answer", 1, 1.0)] * 2
    assert [e.prompt_ids + e.ids for e in played] == [e.prompt_ids + e.ids for e in hosted]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


KILLED_PARENT = """
import sys, time
from ladle.agents import environments, programs
from ladle.agents.episodes import Episode

entry, pid_file = sys.argv[1:]
env = environments.load(entry, environments.bundle(entry))
with programs.Endpoint(wait_s=600) as endpoint:
    eps = {0: Episode({"prompt": "hi", "columns": {"pid_file": pid_file}}, [], [{"role": "user", "content": "hi"}])}
    host = programs.Programs()
    host.begin(env, endpoint, eps, 600)
    print(host.proc.pid, flush=True)
    time.sleep(600)
"""


def test_a_program_and_what_it_started_die_with_a_killed_training_process(program_file, tmp_path):
    import signal
    import subprocess
    import sys

    pid_file = tmp_path / "pid"
    parent = subprocess.Popen(
        [sys.executable, "-c", KILLED_PARENT, f"{program_file}:forever", str(pid_file)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        host = int(parent.stdout.readline())
        deadline = time.monotonic() + 60
        while not pid_file.is_file() and time.monotonic() < deadline:  # the program's child is running
            time.sleep(0.05)
        child = int(pid_file.read_text())
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (alive(host) or alive(child)):
            time.sleep(0.05)
        assert not alive(host) and not alive(child)
    finally:
        if parent.poll() is None:
            parent.kill()


def test_a_function_that_cannot_be_a_program_is_one_error_naming_it(tmp_path):
    path = tmp_path / "bad.py"
    path.write_text("def agent(client):\n    return 1\n")
    entry = f"{path}:agent"
    with pytest.raises(environments.EnvironmentError_, match=r"cannot be called as program\(client, model, messages"):
        environments.load(entry, environments.bundle(entry))
