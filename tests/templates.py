"""Chat templates that teach the tiny model tool calls, in the two formats ladle parses (its own template renders
no tools): Hermes's ``<tool_call>`` JSON and Llama 3's ``{"name", "parameters"}`` JSON. Used by the serving and
the data tests."""

from __future__ import annotations

import shutil
from pathlib import Path

HERMES_TEMPLATE = (
    "{{ bos_token }}{%- if tools %}<|system|>\nYou may call these functions:\n{% for t in tools %}{{ t | tojson }}\n"
    '{% endfor %}Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call><|end|>\n{% endif %}'
    "{%- for m in messages %}{%- if m.role == 'assistant' and m.tool_calls %}<|assistant|>\n"
    "{% for c in m.tool_calls %}<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}"
    "</tool_call>{% endfor %}<|end|>\n{% elif m.role == 'tool' %}<|user|>\n<tool_response>{{ m.content }}"
    "</tool_response><|end|>\n{% else %}<|{{ m.role }}|>\n{{ m.content }}<|end|>\n{% endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{%- if tools %}<|system|>\nAnswer a function call as "
    '{"name": function name, "parameters": its arguments}. Functions:\n{% for t in tools %}{{ t | tojson }}\n'
    "{% endfor %}<|end|>\n{% endif %}{%- for m in messages %}{%- if m.role == 'assistant' and m.tool_calls %}"
    "<|assistant|>\n{% for c in m.tool_calls %}{{ {'name': c.function.name, 'parameters': c.function.arguments} "
    "| tojson }}{% endfor %}<|end|>\n{% elif m.role == 'tool' %}<|ipython|>\n{{ m.content }}<|end|>\n{% else %}"
    "<|{{ m.role }}|>\n{{ m.content }}<|end|>\n{% endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
TEMPLATES = {"hermes": HERMES_TEMPLATE, "llama3_json": LLAMA3_TEMPLATE}


def with_template(model: Path, folder: Path, template: str) -> Path:
    """A copy of ``model`` whose tokenizer carries ``template``."""
    shutil.copytree(model, folder)
    (folder / "chat_template.jinja").write_text(template)
    return folder


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Lima"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
"""A tool whose arguments the tiny model can only write one way or another (an enum)."""


def assert_one_forced_call(url: str, **fields) -> None:
    """A forced call of ``WEATHER`` at ``url`` (a server whose model has a tool-calling template; ``fields``: more
    of the body, e.g. ``model``) is one valid call, whole and streamed, the same call both ways."""
    import json

    import httpx

    body = {
        "messages": [{"role": "user", "content": "weather?"}],
        "tools": [WEATHER],
        "tool_choice": "required",
        "max_tokens": 200,
        "temperature": 0,
        **fields,
    }
    whole = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
    assert whole["finish_reason"] == "tool_calls"
    (call,) = whole["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"])["city"] in ("Paris", "Lima")
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=60) as answer:
        chunks = [json.loads(line[6:]) for line in answer.iter_lines() if line.startswith("data: {")]
    calls = [c for x in chunks if x["choices"] for c in x["choices"][0]["delta"].get("tool_calls") or []]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("get_weather", call["function"]["arguments"])
    ]
