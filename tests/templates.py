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
