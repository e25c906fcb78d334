"""Tool calls through the OpenAI SDK against the tiny model given two tool-calling chat templates: Hermes's
``<tool_call>`` JSON and Llama 3's JSON. The template renders the tools and the conversation's calls and results;
``required`` and a named function make the answer one valid call (its arguments by the function's schema, at
temperature 1 too), streamed as OpenAI streams calls; ``auto`` parses what the model wrote; a template without
tools is refused with the reason; a backend without token masks refuses a forced call by name."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import jsonschema
import openai
import pytest

from ladle.serve import tools as tools_api
from ladle.serve.backends import TransformersBackend
from ladle.serve.jobs import constraint_of, tools_of
from ladle.serve.schema import ApiError, ChatRequest
from ladle.serve.server import Settings, create_app
from tests.serve.running import Running
from tests.templates import HERMES_TEMPLATE, TEMPLATES, with_template

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Lima"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "weather in Paris?"}]


@pytest.fixture(scope="module", params=["hermes", "llama3_json"])
def served(request, tiny_model, tmp_path_factory):
    folder = with_template(tiny_model, tmp_path_factory.mktemp("tools") / request.param, TEMPLATES[request.param])
    backend = TransformersBackend(str(folder), max_batch=8)
    running = Running(create_app(backend, Settings("tiny", max_new_tokens=16)))
    client = openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0)
    yield request.param, backend, client
    running.stop()


def arguments_of(call, tool: dict) -> dict:
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, tool["function"]["parameters"])
    return args


def test_the_template_renders_the_tools_and_the_conversations_calls(served):
    name, backend, _ = served
    assert tools_api.format_of(backend.tokenizer.chat_template).name == name
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21 C"},
    ]
    req = ChatRequest(messages=history, tools=[WEATHER])
    text = backend.tokenizer.decode(backend.encode_chat(tools_api.template_messages(req.messages), [WEATHER]))
    assert '"name": "get_weather"' in text and "The weather in a city." in text  # the tool list
    assert '{"name": "get_weather", "' in text.split("weather in Paris?")[1]  # the earlier call
    assert "sunny, 21 C" in text  # its result


def test_required_makes_one_valid_call_at_temperature_one(served):
    _, _, client = served

    def ask(seed: int):
        return client.chat.completions.create(
            model="tiny",
            messages=ASK,
            tools=[WEATHER, TIME],
            tool_choice="required",
            max_tokens=200,
            temperature=1.0,
            seed=seed,
        ).choices[0]

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(8)))
    for answer in answers:
        assert answer.finish_reason == "tool_calls" and len(answer.message.tool_calls) == 1
        call = answer.message.tool_calls[0]
        assert call.id.startswith("call_") and call.type == "function"
        arguments_of(call, WEATHER if call.function.name == "get_weather" else TIME)


def test_a_named_function_is_the_one_called_and_streams_as_openai_streams_calls(served):
    _, _, client = served
    choice = {"type": "function", "function": {"name": "get_time"}}
    reply = client.chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=200, temperature=0
    )
    call = reply.choices[0].message.tool_calls[0]
    assert call.function.name == "get_time" and arguments_of(call, TIME)
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=ASK,
            tools=[WEATHER, TIME],
            tool_choice=choice,
            max_tokens=200,
            temperature=0,
            stream=True,
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed = [t for d in deltas if d.tool_calls for t in d.tool_calls]
    assert [(t.index, t.function.name, t.function.arguments) for t in streamed] == [
        (0, "get_time", call.function.arguments)
    ]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_the_sdks_own_message_goes_back_with_the_result(served):
    """An agent loop as the OpenAI docs write it: the reply's message object appended as it is (the SDK sends
    its ``refusal`` too), then the tool's result."""
    _, _, client = served
    messages = list(ASK)
    reply = client.chat.completions.create(
        model="tiny", messages=messages, tools=[WEATHER], tool_choice="required", max_tokens=200, temperature=0
    )
    call = reply.choices[0].message.tool_calls[0]
    messages += [reply.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "fog, 17 C"}]
    after = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER], max_tokens=4)
    assert after.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_auto_parses_what_the_model_wrote_and_none_parses_nothing(served):
    name, _, client = served
    fmt = tools_api.HERMES if name == "hermes" else tools_api.LLAMA3_JSON
    written = (
        'Let me look. <tool_call>{"name": "get_weather", "arguments": {"city": "Lima", "days": 2}}</tool_call>'
        if name == "hermes"
        else '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Lima", "days": 2}}'
    )
    content, calls = fmt.parse(written)
    assert calls == [{"name": "get_weather", "arguments": {"city": "Lima", "days": 2}}]
    assert content == ("Let me look." if name == "hermes" else None)
    assert fmt.parse("just words") == ("just words", [])
    reply = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], max_tokens=6, temperature=0)
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].message.content  # the tiny model's words
    none = client.chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=6, temperature=0
    )
    assert none.choices[0].message.content == reply.choices[0].message.content


def test_a_template_without_tools_is_refused_with_the_reason(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], max_tokens=4)
    error = err.value.response.json()["error"]
    assert error["param"] == "tools" and "does not render tools" in error["message"]


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"tool_choice": "required"}, "tool_choice", "tool_choice needs tools"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "'nope', which is not among the tools (get_weather)",
        ),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools.0.function.name", ""),
    ],
)
def test_bad_tool_requests_are_a_400_naming_the_field(served, body, param, words):
    _, _, client = served
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=ASK, max_tokens=4, extra_body=body)
    error = err.value.response.json()["error"]
    assert error["param"] == param and words in error["message"]


def test_a_backend_without_token_masks_refuses_a_forced_call_by_name():
    class TextOnly:
        name, constrains_output = "mii", False

        class tokenizer:  # noqa: N801 - the attribute a backend has
            chat_template = HERMES_TEMPLATE

    req = ChatRequest(messages=ASK, tools=[WEATHER], tool_choice="required")
    with pytest.raises(ApiError) as err:
        constraint_of(req, TextOnly(), tools_of(req, TextOnly()))
    assert err.value.param == "tool_choice" and "serve.backend=mii" in str(err.value)
    auto = ChatRequest(messages=ASK, tools=[WEATHER])
    assert constraint_of(auto, TextOnly(), tools_of(auto, TextOnly())) is None  # auto only parses: MII can


def split_all(fmt, pieces: list[str], tag_ids=frozenset(), tokens_at=None) -> tuple[list[str], tools_api.ContentStream]:
    stream, sent, tokens = tools_api.ContentStream(fmt, tag_ids), [], []
    for i, piece in enumerate(pieces):
        tokens += (tokens_at or {}).get(i, [])
        sent.append(stream.feed(piece, tokens))
    return sent, stream


def test_content_streams_up_to_where_a_hermes_call_may_begin():
    pieces = [
        " Let",
        " me",
        " check",
        ".",
        "\n<to",
        "ol_call>",
        '\n{"name": "get_time", ',
        '"arguments": {}}',
        "\n</tool_call>",
    ]
    sent, stream = split_all(tools_api.HERMES, pieces)
    assert sent == [" Let", " me", " check", ".", "", "", "", "", ""]  # a blank or a tag's beginning waits
    content, calls = tools_api.HERMES.parse("".join(pieces))
    assert (content, calls) == (" Let me check.", [{"name": "get_time", "arguments": {}}])
    assert "".join(sent) + stream.rest(content) == content
    # A "<" that turns out not to be a tag goes out with the next tokens; with no call, the whole text is content.
    sent, stream = split_all(tools_api.HERMES, ["a <", "b> c", " "])
    assert sent == ["a", " <b> c", ""] and "".join(sent) + stream.rest("a <b> c ") == "a <b> c "
    # The tag as one special token (absent from the text): held from the token on, the text before it sent at the end.
    sent, stream = split_all(tools_api.HERMES, ["Hi", " there", "{}"], frozenset({7}), {1: [7]})
    assert sent == ["Hi", "", ""] and stream.rest("Hi there") == " there"


def test_a_llama_json_answer_is_held_when_it_opens_a_call_and_streams_otherwise():
    sent, stream = split_all(tools_api.LLAMA3_JSON, ["\n", '{"name": "get_time", ', '"parameters": {}}'])
    assert sent == ["", "", ""] and stream.rest(None) == ""
    sent, _ = split_all(tools_api.LLAMA3_JSON, ["<|python", "_tag|>", "{}"])
    assert sent == ["", "", ""]
    sent, stream = split_all(tools_api.LLAMA3_JSON, [" ", " It", " is", " noon."])
    assert sent == ["", "  It", " is", " noon."] and stream.rest("  It is noon.") == ""


class Scripted(TransformersBackend):
    """The tiny model's tokenizer and template with a written answer: the text a tool-calling model writes before
    its call, which the tiny model does not (the server, the SDK and the stream are real)."""

    answer: list[str] = []

    def submit(self, job) -> None:
        def write():
            for piece in self.answer:
                job.tokens.extend(self.tokenizer.encode(piece, add_special_tokens=False))
                job.emit("text", {"text": piece})
                time.sleep(0.02)
            job.emit(
                "done", {"finish_reason": "stop", "prompt_tokens": len(job.ids), "completion_tokens": len(job.tokens)}
            )

        threading.Thread(target=write, daemon=True).start()


def test_text_before_a_call_streams_before_the_call_is_written(tiny_model, tmp_path):
    folder = with_template(tiny_model, tmp_path / "hermes", HERMES_TEMPLATE)
    backend = Scripted(str(folder), max_batch=2)
    backend.answer = [
        "Let",
        " me",
        " look",
        " it",
        " up.",
        "\n<tool_call>",
        '\n{"name": "get_time", "arguments": ',
        '{"zone": "CET"}}\n</tool_call>',
    ]
    running = Running(create_app(backend, Settings("tiny", max_new_tokens=64)))
    try:
        client = openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0)
        whole = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER, TIME]).choices[0]
        assert whole.message.content == "Let me look it up." and whole.finish_reason == "tool_calls"
        chunks = list(client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER, TIME], stream=True))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        texts = [d.content for d in deltas if d.content]
        assert texts[:5] == ["Let", " me", " look", " it", " up."]  # each as it was written, not all at the end
        first_call = next(i for i, d in enumerate(deltas) if d.tool_calls)
        assert all(not d.content for d in deltas[first_call:])
        assert "".join(texts) == whole.message.content
        calls = [t for d in deltas if d.tool_calls for t in d.tool_calls]
        assert [(t.function.name, json.loads(t.function.arguments)) for t in calls] == [("get_time", {"zone": "CET"})]
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    finally:
        running.stop()
        backend.close()


def test_langchains_chat_openai_binds_a_tool_and_gets_the_call_back(served):
    """LangChain's ``ChatOpenAI`` (langchain-openai), a client this project did not write: a tool bound from a
    typed Python function, the call parsed into its ``tool_calls``, whole and streamed."""
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_time(zone: Literal["UTC", "CET"]) -> str:
        """The time in a zone."""
        return "12:00"

    _, _, client = served
    chat = ChatOpenAI(base_url=str(client.base_url), api_key="unused", model="tiny", temperature=0, max_retries=0)
    bound = chat.bind_tools([get_time], tool_choice="get_time", strict=True)  # strict: no properties of its own
    message = bound.invoke("What time is it in Paris?", max_tokens=200)
    assert [c["name"] for c in message.tool_calls] == ["get_time"], (message, message.response_metadata)
    assert message.tool_calls[0]["args"]["zone"] in ("UTC", "CET")
    streamed = None
    for chunk in bound.stream("What time is it in Paris?", max_tokens=200):
        streamed = chunk if streamed is None else streamed + chunk
    assert streamed.tool_calls == [{**message.tool_calls[0], "id": streamed.tool_calls[0]["id"]}]
    assert get_time.invoke(message.tool_calls[0]["args"]) == "12:00"


def test_llama_json_calls_whose_arguments_hold_the_separator_parse_whole():
    """Llama 3's calls are JSON objects separated by ';': a ';' inside an argument is the string's, so a forced
    call with a SQL argument is a call, not plain content with finish_reason stop."""
    fmt = tools_api.LLAMA3_JSON
    sql = '{"name": "run_sql", "parameters": {"query": "SELECT 1; SELECT 2"}}'
    assert fmt.parse(sql) == (None, [{"name": "run_sql", "arguments": {"query": "SELECT 1; SELECT 2"}}])
    two = f'<|python_tag|>{sql} ; {{"name": "get_time", "parameters": {{}}}}'
    assert [c["name"] for c in fmt.parse(two)[1]] == ["run_sql", "get_time"]
    assert fmt.parse(two)[1][0]["arguments"]["query"] == "SELECT 1; SELECT 2"
    # not calls: words after the object, an unclosed object, a list: the text comes back as content
    for text in (sql + " and then some", '{"name": "run_sql", "parameters": {"query": "x;', '{"name": 3}'):
        assert fmt.parse(text) == (text, [])
