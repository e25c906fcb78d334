"""Property-based fuzzing of the HTTP API from its own OpenAPI schema (schemathesis): requests that fit the schema
and requests that break it, to every route, over real HTTP, straight to the server and through the front. None
gets a 5xx, and the server is still ready after each. Bounded: a fixed number of examples per route, and the
server's ``serve.limits`` keep each generation short."""

from __future__ import annotations

import os
from types import SimpleNamespace

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from ladle.fleet import front as router
from ladle.serve.backends import TransformersBackend
from ladle.serve.limits import ServeLimits
from ladle.serve.server import Settings, create_app
from tests.serve.running import Running

# The schema the server publishes, read from its app (routes only: nothing is served here).
ROUTES_ONLY = SimpleNamespace(queue_depth=lambda: 0, name="-", report_batches=lambda observe: None, context_length=2048)
SCHEMA = schemathesis.openapi.from_dict(create_app(ROUTES_ONLY, "tiny").openapi())
# LADLE_FUZZ_EXAMPLES: more examples for a longer hunt outside the suite (the suite's 25 are fixed, derandomized).
EXAMPLES = settings(
    max_examples=int(os.environ.get("LADLE_FUZZ_EXAMPLES", "25")),
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize="LADLE_FUZZ_EXAMPLES" not in os.environ,
    database=None,
)
LIMITS = ServeLimits(max_tokens=8, max_body_bytes=64 * 1024, max_queue=64)


@pytest.fixture(scope="module")
def server(tiny_model):
    backend = TransformersBackend(str(tiny_model), max_batch=4)
    running = Running(create_app(backend, Settings("tiny", max_new_tokens=4, limits=LIMITS)))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def front(server):
    upstream = {"url": server.url, "version": "1", "pid": None, "model_dir": "x"}
    running = Running(router.create_app("tiny", "t", {"upstream": upstream}, None))
    yield running
    running.stop()


def still_ready(url: str) -> None:
    answer = httpx.get(f"{url}/ready", timeout=30)
    assert answer.status_code == 200, answer.text


@SCHEMA.parametrize()
@EXAMPLES
def test_the_server_never_answers_a_5xx(case, server):
    case.call_and_validate(base_url=server.url, checks=[not_a_server_error], timeout=60)
    still_ready(server.url)


@SCHEMA.parametrize()
@EXAMPLES
def test_the_front_never_answers_a_5xx(case, front):
    case.call_and_validate(base_url=front.url, checks=[not_a_server_error], timeout=60)
    still_ready(front.url)
