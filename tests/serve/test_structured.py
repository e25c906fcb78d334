"""Structured outputs (``response_format``) on the tiny model's server, asked through the OpenAI SDK: every answer
that ends parses and validates against its schema, greedy and at temperature 1; constrained and free rows share a
batch without the masks reaching the free ones; a schema that cannot be enforced is a 400 naming the part; a
backend without token masks refuses it by name; the front relays it."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from ladle.serve.jobs import constraint_of
from ladle.serve.schema import ApiError, ChatRequest, ResponseFormat
from tests.serve.running import Running

MESSAGES = [{"role": "user", "content": "pick one"}]


class Pick(BaseModel):
    colour: Literal["red", "green", "blue"]
    count: int = Field(ge=0, le=9)
    ok: bool


STRICT_PICK = {**Pick.model_json_schema(), "additionalProperties": False}  # as the SDK's parse sends it
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "sizes": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 3},
        "kind": {"enum": ["a", "b"]},
    },
    "required": ["name", "sizes", "kind"],
    "additionalProperties": False,
}


def test_the_sdks_parse_returns_the_pydantic_object(client):
    reply = client.chat.completions.parse(
        model="tiny", messages=MESSAGES, response_format=Pick, max_tokens=100, temperature=0
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Pick)
    assert Pick.model_validate_json(choice.message.content) == choice.message.parsed


def test_every_answer_at_temperature_one_parses_and_validates(client):
    """16 seeded requests at once, sampled at temperature 1 (the tiny model's free answers are noise): each is
    JSON that the schema accepts."""
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}

    def ask(seed: int):
        return client.chat.completions.create(
            model="tiny", messages=MESSAGES, response_format=fmt, max_tokens=120, temperature=1.0, seed=seed
        ).choices[0]

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, range(16)))
    assert {a.finish_reason for a in answers} == {"stop"}
    for answer in answers:
        jsonschema.validate(json.loads(answer.message.content), SCHEMA)
    assert len({a.message.content for a in answers}) > 1  # sampled, not one forced answer


def test_constrained_and_free_rows_share_a_batch_and_free_rows_are_untouched(client):
    free = {"model": "tiny", "messages": MESSAGES, "max_tokens": 12, "temperature": 0}
    alone = client.chat.completions.create(**free).choices[0].message.content

    def ask(n: int):
        if n % 2:
            return client.chat.completions.create(**free).choices[0].message.content
        fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
        return client.chat.completions.create(**{**free, "max_tokens": 120, "response_format": fmt}).choices[0]

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(ask, range(8)))
    assert [g for n, g in enumerate(got) if n % 2] == [alone] * 4
    for answer in (g for n, g in enumerate(got) if not n % 2):
        jsonschema.validate(json.loads(answer.message.content), SCHEMA)


def test_json_object_and_streaming(client, backend):
    # The tiny model would fill an open key forever: a bias toward the closing brace ends the object at once,
    # and the grammar still decides what may follow the opening one.
    close = str(backend.tokenizer.convert_tokens_to_ids("}"))
    reply = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        response_format={"type": "json_object"},
        max_tokens=20,
        temperature=0,
        logit_bias={close: 100},
    )
    assert reply.choices[0].finish_reason == "stop" and json.loads(reply.choices[0].message.content) == {}
    stream = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        response_format={"type": "json_schema", "json_schema": {"name": "pick", "schema": STRICT_PICK}},
        max_tokens=100,
        temperature=0,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    Pick.model_validate_json(text)


@pytest.mark.parametrize(
    ("response_format", "param", "words"),
    [
        (
            {"type": "json_schema", "json_schema": {"name": "a", "schema": {"properties": {"x": {"$ref": "#/nope"}}}}},
            "response_format.json_schema.schema",
            "Pointer '/nope' does not exist",
        ),
        ({"type": "json_schema"}, "response_format", "needs json_schema"),
        ({"type": "yaml"}, "response_format.type", "json_schema"),
        ({"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}, "response_format.json_schema.name", ""),
    ],
)
def test_a_format_that_cannot_be_enforced_is_a_400_naming_the_part(client, response_format, param, words):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, response_format=response_format)
    error = err.value.response.json()["error"]
    assert error["param"] == param and words in error["message"]


def test_a_backend_without_token_masks_refuses_it_by_name():
    class TextOnly:
        name, constrains_output = "mii", False

    req = ChatRequest(messages=MESSAGES, response_format=ResponseFormat(type="json_object"))
    with pytest.raises(ApiError) as err:
        constraint_of(req, TextOnly())
    assert err.value.status == 400 and err.value.param == "response_format"
    assert "serve.backend=mii" in str(err.value) and "serve.backend=transformers" in str(err.value)
    assert (
        constraint_of(ChatRequest(messages=MESSAGES, response_format=ResponseFormat(type="text")), TextOnly()) is None
    )


def test_the_front_and_a_canary_relay_structured_outputs(server, backend):
    """Through the front, with a canary taking half the traffic: both arms answer a parseable object (the
    challenger is a second server over the same model)."""
    import httpx

    from ladle.fleet import front as fronts
    from ladle.serve.server import Settings, create_app

    challenger = Running(create_app(backend, Settings("tiny", max_new_tokens=16)))
    upstream = {"url": server.url, "version": "1", "pid": None, "model_dir": "x"}
    front = Running(fronts.create_app("tiny", "t", {"upstream": upstream}, None))
    admin = {fronts.ADMIN_HEADER: "t"}
    try:
        canary = {"url": challenger.url, "version": "2", "pid": None, "model_dir": "-"}
        canary["limits"] = {"weight": 0.5, "duration_s": 600, "min_requests": 1000}  # running throughout
        assert httpx.put(f"{front.url}/ladle/canary", json=canary, headers=admin).status_code == 200
        via = openai.OpenAI(base_url=f"{front.url}/v1", api_key="unused", max_retries=0)
        versions = set()
        for _ in range(20):  # half to each arm at random: all 20 on one arm is a 2-in-a-million chance
            reply = via.chat.completions.with_raw_response.parse(
                model="tiny", messages=MESSAGES, response_format=Pick, max_tokens=100, temperature=0
            )
            assert isinstance(reply.parse().choices[0].message.parsed, Pick)
            versions.add(reply.headers[fronts.VERSION_HEADER])
        assert versions == {"1", "2"}  # both arms answered
        arms = httpx.get(f"{front.url}/ladle/canary", headers=admin).json()["canary"]["arms"]
        assert arms["challenger"]["errors"] == arms["champion"]["errors"] == 0
    finally:
        front.stop()
        challenger.stop()
