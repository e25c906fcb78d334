"""The OpenAI-compatible server over real HTTP on 127.0.0.1, called by the official ``openai`` client:
chat and completions, streaming and not, stop strings, seeds, usage, every error shape, API keys,
cancellation on disconnect, and batched greedy == unbatched greedy == offline greedy."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from ladle.serve.backends import TransformersBackend
from ladle.serve.server import Settings, create_app
from tests.helpers import offline_greedy
from tests.serve.running import Running

PROMPTS = ["Add 2 and 3.", "Name a colour.", "blue red", "Count to five please, slowly.", "x", "Hello there!"]


@pytest.fixture(scope="module")
def backend(tiny_model):
    return TransformersBackend(str(tiny_model), max_batch=8)


@pytest.fixture(scope="module")
def server(backend):
    running = Running(create_app(backend, Settings("tiny", max_new_tokens=12)))
    yield running
    running.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_health_ready_models_metrics(server):
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok", "model": "tiny", "backend": "transformers"}
    assert httpx.get(f"{server.url}/ready").json()["status"] == "ready"
    assert httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"] == "tiny"
    assert "ladle_requests_total" in httpx.get(f"{server.url}/metrics").text


def test_chat_is_offline_greedy_and_streams_the_same_text(client, tiny_model):
    messages = [{"role": "user", "content": "Add 2 and 3."}]
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    assert reply.object == "chat.completion" and reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == offline_greedy(tiny_model, messages, 8)
    assert reply.choices[0].finish_reason in ("stop", "length") and 0 < reply.usage.completion_tokens <= 8
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens

    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reply.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [reply.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == reply.usage.completion_tokens


def test_default_max_tokens_comes_from_the_server_settings(client):
    reply = client.completions.create(model="tiny", prompt="Add", temperature=0)
    assert reply.choices[0].finish_reason == "stop" or reply.usage.completion_tokens == 12


def test_completions_stream_and_not(client):
    whole = client.completions.create(model="tiny", prompt="Add 2 and", max_tokens=6, temperature=0)
    assert whole.object == "text_completion"
    streamed = client.completions.create(model="tiny", prompt="Add 2 and", max_tokens=6, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text


def test_stop_string_ends_the_answer_before_it(client):
    messages = [{"role": "user", "content": "Translate the colours to numbers.\nblue red blue"}]
    full = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    text = full.choices[0].message.content
    # A stop string that first occurs after the answer's start, so the cut leaves something before it.
    stop = next(text[i : i + 2] for i in range(1, len(text) - 1) if text.find(text[i : i + 2]) == i)
    cut = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].message.content == text[: text.find(stop)] != ""
    assert cut.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=12, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text[: text.find(stop)]


def test_seed_makes_sampling_reproducible(client):
    def sample(seed):
        return client.completions.create(model="tiny", prompt="Name", max_tokens=10, temperature=1.5, seed=seed)

    assert sample(7).choices[0].text == sample(7).choices[0].text
    assert len({sample(s).choices[0].text for s in range(6)}) > 1  # and it does sample


def test_batched_greedy_equals_unbatched_and_offline(backend, server, tiny_model):
    """Eight different prompts at once share batches; each answer is the one it gets alone and offline."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)

    def ask(prompt):
        messages = [{"role": "user", "content": prompt}]
        return client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)

    alone = {p: ask(p).choices[0].message.content for p in PROMPTS}
    with ThreadPoolExecutor(len(PROMPTS) * 2) as pool:
        together = list(pool.map(ask, PROMPTS * 2))
    assert [r.choices[0].message.content for r in together] == [alone[p] for p in PROMPTS * 2]
    for prompt in PROMPTS[:3]:
        assert alone[prompt] == offline_greedy(tiny_model, [{"role": "user", "content": prompt}], 10)
    metrics = {
        line.split()[0]: float(line.split()[1])
        for line in httpx.get(f"{server.url}/metrics").text.splitlines()
        if line.startswith("ladle_batch_size_")
    }
    assert metrics["ladle_batch_size_sum"] > metrics["ladle_batch_size_count"]  # some batch held several requests


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"model": "other", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
        ({"messages": []}, 400, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 2}, 400, "n"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": "lots"}, 400, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": 3}, 400, "temperature"),
        ({"messages": [{"role": "user", "content": "x"}], "echo": True}, 400, "echo"),
        ({"messages": [{"role": "user", "content": "x"}], "colour": "red"}, 400, "colour"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 4000}, 400, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 100_000}, 400, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 5000}, 400, "max_completion_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "stop": "s" * 257}, 400, "stop"),
        ({"messages": [{"role": "user", "content": "x"}], "seed": 2**64}, 400, "seed"),
        ({"messages": [{"role": "user", "content": "x"}] * 513}, 400, "messages"),
        ({"messages": [{"role": "user", "content": "x" * 65_537}]}, 400, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ],
)
def test_bad_requests_get_the_openai_error_envelope(server, body, status, param):
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body)
    error = response.json()["error"]
    assert response.status_code == status and error["param"] == param, response.text
    assert set(error) == {"message", "type", "param", "code"} and error["message"]


def test_malformed_json_and_the_sdk_errors(server, client):
    response = httpx.post(
        f"{server.url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model="tiny", prompt="x " * 3000, max_tokens=10)


def test_api_key(backend):
    running = Running(create_app(backend, Settings("tiny", api_key="s3cret")))
    try:
        body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
        denied = httpx.post(f"{running.url}/v1/chat/completions", json=body)
        assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{running.url}/v1", api_key="wrong", max_retries=0).chat.completions.create(
                model="tiny", messages=body["messages"]
            )
        good = openai.OpenAI(base_url=f"{running.url}/v1", api_key="s3cret", max_retries=0)
        assert good.chat.completions.create(model="tiny", messages=body["messages"], max_tokens=2).choices
        assert httpx.get(f"{running.url}/health").status_code == 200  # liveness needs no key
    finally:
        running.stop()


def test_a_client_that_disconnects_cancels_its_generation(server):
    def cancelled() -> float:
        lines = httpx.get(f"{server.url}/metrics").text.splitlines()
        return next(float(line.split()[-1]) for line in lines if line.startswith("ladle_cancelled_total"))

    before = cancelled()
    body = {"prompt": "Count", "max_tokens": 200, "temperature": 1.0, "stream": True, "seed": 1}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body) as response:
        next(response.iter_lines())  # the first chunk arrived; now hang up
    deadline = time.monotonic() + 30
    while cancelled() == before:
        assert time.monotonic() < deadline, "the generation was not cancelled"
        time.sleep(0.1)


def test_sse_format_ends_with_done(server):
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body) as response:
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    first = json.loads(lines[0].removeprefix("data: "))
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
