"""The serving tests' shared set-up: the tiny model's transformers backend and a real server over it, one per
module (a module that needs other settings defines its own fixtures of these names)."""

from __future__ import annotations

import openai
import pytest

from ladle.serve.backends import TransformersBackend
from ladle.serve.server import Settings, create_app
from tests.serve.running import Running


@pytest.fixture(scope="module")
def backend(tiny_model):
    return TransformersBackend(str(tiny_model), max_batch=8)


@pytest.fixture(scope="module")
def server(backend):
    running = Running(create_app(backend, Settings("tiny", max_new_tokens=16)))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
