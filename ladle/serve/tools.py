"""Tool calls (``tools``, ``tool_choice``): the tool list rendered by the model's own chat template, the model's
tool-call format parsed back into OpenAI's ``tool_calls``, and ``required`` or a named function enforced by the
same token masks as structured outputs (``ladle.serve.structured``).

A model calls tools in the format its template teaches it, so the format is read from the template:

- **Hermes** (Qwen 2/2.5/3, Hermes, many fine-tunes): each call is ``<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>``, text before the first call is the message's content.
- **Llama 3.1+ JSON**: the answer is ``{"name": ..., "parameters": {...}}`` (calls separated by ``;``), optionally
  after ``<|python_tag|>``.

A template that renders no ``tools`` cannot tell the model about them, and one whose call format is neither is
not guessed at: both are refused with the reason. ``tool_choice: none`` renders the tools and parses nothing;
``auto`` parses what the model wrote; ``required`` and a named function constrain the answer to one call of the
allowed functions, its arguments to the function's ``parameters`` schema.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=NAME_PATTERN)


class NamedChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: NamedFunction


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: str


class ToolCall(BaseModel):
    """A call in an assistant message the client sends back (OpenAI's shape: arguments as a JSON string)."""

    model_config = ConfigDict(extra="forbid")
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ToolError(ValueError):
    """A tools request this model or server cannot serve; ``param`` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Format:
    """One tool-call format: how calls are written, parsed and constrained."""

    name: str

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """The message content and the calls (``{"name", "arguments"}`` with arguments a dict) in ``text``; no
        calls when the text is not a call in this format."""
        if self.name == "hermes":
            calls = []
            for body in re.findall(r"<tool_call>\s*(.*?)\s*</tool_call>", text, flags=re.S):
                call = loads(body)
                if call is None or not isinstance(call.get("name"), str):
                    return text, []
                calls.append({"name": call["name"], "arguments": call.get("arguments", {})})
            content = text.split("<tool_call>", 1)[0].rstrip() if calls else text
            return content or None, calls
        body = text.strip().removeprefix("<|python_tag|>").strip()
        calls = []
        for call in json_objects(body, ";") if body.startswith("{") else []:
            if call is None or not isinstance(call.get("name"), str):
                return text, []
            calls.append({"name": call["name"], "arguments": call.get("parameters", call.get("arguments", {}))})
        return (None if calls else text), calls

    def grammar(self, tools: list[Tool], special: set[str]) -> str:
        """llguidance's grammar for exactly one call of one of ``tools`` (Lark, the arguments by their schema)."""
        key = "arguments" if self.name == "hermes" else "parameters"
        options = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": t.function.name},
                    key: t.function.parameters or {"type": "object"},
                },
                "required": ["name", key],
                "additionalProperties": False,
            }
            for t in tools
        ]
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        # llguidance's JSON options ride in the schema: no free whitespace (a sampled answer could be all spaces)
        schema = json.dumps({**schema, "x-guidance": {"whitespace_flexible": False}})
        if self.name != "hermes":
            return f"start: %json {schema}\n"
        # A tag the tokenizer has as a special token is that token (``<tool_call>``), else its text.
        opening = "<tool_call>" if "<tool_call>" in special else '"<tool_call>"'
        closing = "</tool_call>" if "</tool_call>" in special else '"</tool_call>"'
        return f'start: {opening} "\\n" %json {schema} "\\n" {closing}\n'


HERMES, LLAMA3_JSON = Format("hermes"), Format("llama3_json")
HERMES_TAG, PYTHON_TAG = "<tool_call>", "<|python_tag|>"


class ContentStream:
    """A streamed answer that may hold tool calls, split as it arrives: the content to send now, and what is held
    back until the answer is whole and parsed.

    - **Hermes**: content streams as it is written, up to where a call may begin. Text that could be the start
      of ``<tool_call>`` (``"<tool"``) and trailing blanks (a call's content ends before them) wait for the next
      tokens; once the tag is written (as text, or as its special token, seen in the answer's token ids) nothing
      more is sent until the end.
    - **Llama 3 JSON**: a call is the whole answer, so the first non-blank character decides: ``{`` or
      ``<|python_tag|>`` holds the answer until the end, anything else streams as it comes.

    What was sent is always the start of the final content, so ``rest`` completes it exactly: streamed content
    joins to the whole answer's.
    """

    def __init__(self, fmt: Format, tag_ids: set[int] | frozenset = frozenset()) -> None:
        self.fmt, self.tag_ids = fmt, tag_ids
        self.text, self.sent = "", 0  # the answer so far; how much of it was sent
        self.holding, self.scanned = False, 0

    def feed(self, piece: str, tokens: list[int]) -> str:
        """The content to send now, given the answer's next ``piece`` of text and its token ids so far."""
        self.text += piece
        while not self.holding and self.scanned < len(tokens):  # a call tag that is one special token
            self.holding = tokens[self.scanned] in self.tag_ids
            self.scanned += 1
        if self.holding:
            return ""
        end = self.safe_end()
        delta = self.text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return delta

    def safe_end(self) -> int:
        """How far content may be sent now (setting ``holding`` when a call has begun)."""
        if self.fmt.name != "hermes":
            head = self.text.lstrip()
            if head.startswith(("{", PYTHON_TAG)):
                self.holding = True
                return self.sent
            return self.sent if PYTHON_TAG.startswith(head) else len(self.text)  # blank so far, or maybe a tag
        at = self.text.find(HERMES_TAG)
        if at >= 0:
            self.holding = True
            return len(self.text[:at].rstrip())
        end = len(self.text)
        for k in range(min(len(HERMES_TAG) - 1, end), 0, -1):  # a tag maybe being written
            if self.text.endswith(HERMES_TAG[:k]):
                end -= k
                break
        return len(self.text[:end].rstrip())

    def rest(self, final: str | None) -> str:
        """What is left to send of the answer's final content."""
        final, sent = final or "", self.text[: self.sent]
        return final[len(sent) :] if final.startswith(sent) else ""


def tag_ids(fmt: Format, tokenizer) -> frozenset:
    """The token ids of ``fmt``'s call tag where the tokenizer has it as one special token."""
    tag = HERMES_TAG if fmt.name == "hermes" else PYTHON_TAG
    if tokenizer is None or tag not in set(getattr(tokenizer, "all_special_tokens", [])):
        return frozenset()
    return frozenset({tokenizer.convert_tokens_to_ids(tag)})


def json_objects(text: str, separator: str) -> list[dict | None]:
    """The JSON objects of ``text`` written one after another with ``separator`` (and any whitespace) between,
    each read by the JSON decoder itself, so a separator inside a string (``"SELECT 1; SELECT 2"``) is the
    string's; a ``None`` in the list where what follows is not such an object."""
    decoder, found, at = json.JSONDecoder(), [], 0
    while at < len(text):
        try:
            value, end = decoder.raw_decode(text, at)
        except ValueError:
            return [*found, None]
        found.append(value if isinstance(value, dict) else None)
        rest = text[end:].lstrip()
        if not rest:
            break
        if not rest.startswith(separator):
            return [*found, None]
        rest = rest[len(separator) :].lstrip()
        at = len(text) - len(rest)
    return found


def loads(text: str) -> dict | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def format_of(template: str | None) -> Format:
    """The tool-call format ``template`` teaches its model.

    Raises:
        ToolError: the template renders no tools, or writes calls in a format ladle does not parse.
    """
    if not template or "tools" not in template:
        raise ToolError(
            "this model's chat template does not render tools (it never reads a `tools` variable), so the model "
            "cannot be told about them. Serve a model whose template does (Qwen 2.5, Llama 3.1, Hermes, ...), or "
            "leave tools out",
            "tools",
        )
    if "<tool_call>" in template:
        return HERMES
    if "python_tag" in template or '"parameters"' in template:
        return LLAMA3_JSON
    raise ToolError(
        "this model's chat template renders tools but writes tool calls in a format ladle does not parse (it "
        "parses Hermes `<tool_call>` JSON and Llama 3 JSON). Leave tools out, or serve a model with one of those",
        "tools",
    )


def template_messages(messages: list) -> list[dict]:
    """OpenAI messages as chat templates take them: an assistant's tool calls with their arguments as objects
    (templates write them with ``tojson``), a tool result with its call's id."""
    out = []
    for m in messages:
        item: dict = {"role": "system" if m.role == "developer" else m.role, "content": m.content or ""}
        if m.tool_calls:
            item["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": loads(c.function.arguments) or {}},
                }
                for c in m.tool_calls
            ]
        if m.tool_call_id:
            item["tool_call_id"] = m.tool_call_id
        if m.name and m.role == "tool":  # the function a result is of: templates that head results with it read it
            item["name"] = m.name
        out.append(item)
    return out


def chosen(tools: list[Tool], choice) -> list[Tool] | None:
    """The tools one call must come from (None: the model decides, ``auto``; empty: ``none``).

    Raises:
        ToolError: a named function that is not among ``tools``.
    """
    if choice in (None, "auto"):
        return None
    if choice == "none":
        return []
    if choice == "required":
        return tools
    named = [t for t in tools if t.function.name == choice.function.name]
    if not named:
        known = ", ".join(t.function.name for t in tools)
        raise ToolError(
            f"tool_choice names function {choice.function.name!r}, which is not among the tools ({known})",
            "tool_choice",
        )
    return named


def openai_calls(calls: list[dict]) -> list[dict]:
    """Parsed calls as OpenAI's ``tool_calls``: an id each, arguments as a JSON string."""
    return [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])},
        }
        for c in calls
    ]
