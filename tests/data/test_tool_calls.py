"""Tool-calling conversations as training data: OpenAI's shape (a ``tools`` list, assistant turns with
``tool_calls``, ``tool`` turns with the results) through the base's chat template, in both call formats ladle
serves. The assistant's calls and its final answer are trained; the tool list, the user's turns and the tool
results are context. Bad rows are rejected with the reason."""

from __future__ import annotations

import json
import re

import pytest
from transformers import AutoTokenizer

from ladle.data.formats import RowError, parse_messages
from ladle.data.tokenize import IGNORE, tokenize_batch
from tests.templates import TEMPLATES, with_template

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
ROW = {
    "tools": [WEATHER],
    "messages": [
        {"role": "user", "content": "weather in Lima?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lima"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "fog, 17 C"},
        {"role": "assistant", "content": "Foggy, 17 degrees."},
    ],
}


@pytest.fixture(scope="module", params=list(TEMPLATES))
def tokenizer(request, tiny_model, tmp_path_factory):
    folder = with_template(tiny_model, tmp_path_factory.mktemp("tok") / request.param, TEMPLATES[request.param])
    return AutoTokenizer.from_pretrained(folder)


def trained_and_context(tokenizer, row) -> tuple[str, str]:
    ((example, _),) = tokenize_batch(tokenizer, [parse_messages(row)], "response", 4096, "truncate")
    assert not isinstance(example, RowError), example
    trained = [t for t, label in zip(example.input_ids, example.labels, strict=True) if label != IGNORE]
    context = [t for t, label in zip(example.input_ids, example.labels, strict=True) if label == IGNORE]
    return tokenizer.decode(trained), tokenizer.decode(context)


def test_the_calls_and_the_answer_are_trained_the_tools_and_results_are_context(tokenizer):
    trained, context = trained_and_context(tokenizer, ROW)
    assert '"name": "get_weather"' in trained and '"city": "Lima"' in trained  # the call, as the template writes it
    assert "Foggy, 17 degrees." in trained
    assert "fog, 17 C" in context and "fog, 17 C" not in trained  # the tool's result
    assert "weather in Lima?" in context and '"parameters"' in context  # the question and the tool list


def test_arguments_as_an_object_render_as_a_string_does(tokenizer):
    as_object = json.loads(json.dumps(ROW))
    as_object["messages"][1]["tool_calls"][0]["function"]["arguments"] = {"city": "Lima"}
    assert trained_and_context(tokenizer, as_object) == trained_and_context(tokenizer, ROW)


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (lambda r: r.pop("tools"), "calls tools but the row lists no tools"),
        (lambda r: r.update(tools=[{"type": "function"}]), "tools must be a list of"),
        (lambda r: r["messages"][1]["tool_calls"][0]["function"].update(arguments="{not json"), "are not JSON"),
        (lambda r: r["messages"][0].update(tool_calls=[]), "only an assistant turn has tool_calls"),
        (lambda r: r["messages"][2].update(content=None), "messages[2].content must be a string"),
    ],
)
def test_bad_tool_rows_are_rejected_with_the_reason(change, words):
    row = json.loads(json.dumps(ROW))
    change(row)
    with pytest.raises(RowError, match=re.escape(words)):
        parse_messages(row)


def test_a_template_without_tools_rejects_the_row(tiny_model):
    plain = AutoTokenizer.from_pretrained(tiny_model)
    ((result, _),) = tokenize_batch(plain, [parse_messages(ROW)], "response", 4096, "truncate")
    assert isinstance(result, RowError) and "does not render them" in str(result)
