import pytest
from fastapi.testclient import TestClient

from ladle.serve.backends import TransformersBackend
from ladle.serve.server import create_app
from tests.helpers import offline_greedy


@pytest.fixture(scope="module")
def client(tiny_model):
    return TestClient(create_app(TransformersBackend(str(tiny_model)), "tiny"))


def test_health_and_models(client):
    assert client.get("/health").json() == {"status": "ok", "model": "tiny", "backend": "transformers"}
    assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"


def test_chat_is_offline_greedy(client, tiny_model):
    messages = [{"role": "user", "content": "Add 2 and 3."}]
    body = client.post("/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 8}).json()
    assert body["choices"][0]["message"]["content"] == offline_greedy(tiny_model, messages, 8)
    assert body["usage"]["completion_tokens"] <= 8


def test_completion(client):
    body = client.post("/v1/completions", json={"prompt": "Add", "max_tokens": 4}).json()
    assert body["object"] == "text_completion" and isinstance(body["choices"][0]["text"], str)


def test_bad_requests(client):
    assert (
        client.post(
            "/v1/chat/completions", json={"model": "other", "messages": [{"role": "user", "content": "x"}]}
        ).status_code
        == 404
    )
    assert client.post("/v1/chat/completions", json={"messages": []}).status_code == 422
    assert (
        client.post("/v1/chat/completions", json={"messages": [{"role": "robot", "content": "x"}]}).status_code == 422
    )
    assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 0}).status_code == 422
