"""Served = trained for tool calls: the server's answer to an agent's held-out first turn parses to the calls the
training rollout parsed (the deploy stage's parity gate), and an OpenAI SDK client runs the same episode against
the server that the rollout ran in training."""

from __future__ import annotations

import json

import openai
import pytest
import torch

from ladle.agents import environments, episodes, held_out
from ladle.agents.builtin import Calculator
from ladle.config.rl import EpisodeConfig
from ladle.lifecycle.parity import ToolCase, check_tool_calls
from ladle.serve.backends import TransformersBackend
from ladle.serve.server import Settings, create_app
from ladle.train import grpo_agent
from tests.serve.running import Running


@pytest.fixture(scope="module")
def served(tool_caller):
    running = Running(
        create_app(TransformersBackend(str(tool_caller), max_batch=4), Settings("agent", max_new_tokens=80))
    )
    yield running
    running.stop()


def test_the_served_model_calls_what_the_rollout_called_and_a_different_call_fails_the_gate(tool_caller, served):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tool_caller)
    model = AutoModelForCausalLM.from_pretrained(tool_caller, dtype=torch.float32).eval()
    env = environments.load("calculator", {})
    rows = [{"prompt": [{"role": "user", "content": q}], "columns": {}} for q in ("What is 2 + 3?", "Add 2 and 3.")]
    settings = episodes.Settings(max_turns=3, max_completion_tokens=80, max_tool_result_tokens=64)
    done = held_out.play(model, tokenizer, "cpu", rows, env, settings, EpisodeConfig(), 4)
    cases = [ToolCase.model_validate(c) for c in grpo_agent.parity_cases([e.record() for e in done], env.tools, 80)]
    assert len(cases) == 2 and cases[0].calls == [{"name": "calculate", "arguments": {"expression": "2 + 3"}}]
    assert check_tool_calls(served.url, "agent", cases) is None
    wrong = cases[1].model_copy(update={"calls": [{"name": "calculate", "arguments": {"expression": "2 + 4"}}]})
    said = check_tool_calls(served.url, "agent", [cases[0], wrong])
    assert said.startswith(
        "tool calls: held-out episode 1: training's rollout called [{'name': 'calculate', 'arguments': {'expression': '2 + 4'}}], the server [{'name': 'calculate', 'arguments': {'expression': '2 + 3'}}]"
    )


def test_an_openai_client_runs_the_trained_episode_against_the_server(served):
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
    tools = list(environments.load("calculator", {}).tools)
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    first = client.chat.completions.create(model="agent", messages=messages, tools=tools, temperature=0)
    assert first.choices[0].finish_reason == "tool_calls"
    (call,) = first.choices[0].message.tool_calls
    result = Calculator().calculate(**json.loads(call.function.arguments))
    messages += [first.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": result}]
    second = client.chat.completions.create(model="agent", messages=messages, tools=tools, temperature=0)
    assert second.choices[0].message.content == "5" and not second.choices[0].message.tool_calls


def test_a_data_rows_tool_conversation_is_sent_to_the_server_in_openais_shape(served):
    """Data rows may leave tool calls' ids out and give arguments as objects; ladle's own requests (the smoke
    request, the parity probe) send them as the OpenAI API takes them."""
    import httpx

    from ladle.data.formats import openai_messages

    row = [
        {"role": "user", "content": "What is 2 + 3?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "calculate", "arguments": {"expression": "2 + 3"}}}],
        },
        {"role": "tool", "content": "5"},
    ]
    sent = openai_messages(row)
    (call,) = sent[1]["tool_calls"]
    assert call["function"]["arguments"] == '{"expression": "2 + 3"}' and sent[2]["tool_call_id"] == call["id"]
    assert row[1]["tool_calls"][0]["function"]["arguments"] == {"expression": "2 + 3"}  # the row itself unchanged
    answer = httpx.post(
        f"{served.url}/v1/chat/completions", json={"model": "agent", "messages": sent, "temperature": 0}, timeout=60
    )
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"] == "5"
    assert (
        httpx.post(f"{served.url}/tokenize", json={"model": "agent", "messages": sent}, timeout=60).status_code == 200
    )
