"""Row formats: each turns one raw row into a sample, or says why it cannot.

A sample is a chat (rendered through the tokenizer's chat template), a plain
text (tokenized as is, closed with EOS), or pre-tokenized ids.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

Messages = list[dict]
KNOWN_ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "system": "system",
}


class RowError(ValueError):
    """A row that cannot be used; the message is the reason shown in the data report."""


@dataclass
class Chat:
    messages: Messages
    tools: list[dict] | None = None
    """The functions the conversation may call (OpenAI's ``tools``), rendered by the chat template."""


@dataclass
class Text:
    text: str


@dataclass
class Tokens:
    input_ids: list[int]
    labels: list[int] | None


Sample = Chat | Text | Tokens


def _text(row: dict, key: str, required: bool = True) -> str:
    value = row.get(key, None if required else "")
    if value is None:
        raise RowError(f"missing field {key!r}")
    if not isinstance(value, str):
        raise RowError(f"field {key!r} must be a string, got {type(value).__name__}")
    return value


def _check_turns(messages: Messages) -> Messages:
    if not messages:
        raise RowError("empty conversation")
    if not any(m["role"] == "assistant" for m in messages):
        raise RowError("no assistant turn to train on")
    if messages[-1]["role"] != "assistant":
        raise RowError("the last turn must be the assistant's")
    return messages


def parse_alpaca(row: dict) -> Chat:
    """instruction/input/output -> one user turn and one assistant turn."""
    instruction, extra, output = _text(row, "instruction"), _text(row, "input", False), _text(row, "output")
    if not instruction.strip() or not output.strip():
        raise RowError("empty instruction or output")
    prompt = f"{instruction}\n{extra}" if extra.strip() else instruction
    return Chat([{"role": "user", "content": prompt}, {"role": "assistant", "content": output}])


def _turns(row: dict, key: str) -> list:
    turns = row.get(key)
    if turns is None:
        raise RowError(f"missing field {key!r}")
    if not isinstance(turns, list):
        raise RowError(f"field {key!r} must be a list of turns, got {type(turns).__name__}")
    if not turns:
        raise RowError("empty conversation")
    return turns


def _parse_turns(row: dict, key: str, role_key: str, text_key: str, roles: dict[str, str]) -> Chat:
    """A list of turns under ``key``, each ``{role_key: <one of roles>, text_key: str}``."""
    out: Messages = []
    for i, turn in enumerate(_turns(row, key)):
        if not isinstance(turn, dict):
            raise RowError(f"{key}[{i}] must be an object with {role_key} and {text_key}")
        role, text = turn.get(role_key), turn.get(text_key)
        if role not in roles:
            raise RowError(f"{key}[{i}].{role_key} = {role!r}: unknown role (known: {', '.join(roles)})")
        if not isinstance(text, str):
            raise RowError(f"{key}[{i}].{text_key} must be a string")
        out.append({"role": roles[role], "content": text})
    return Chat(_check_turns(out))


def parse_messages(row: dict) -> Chat:
    """{"messages": [{role, content}, ...]} with known roles, ending on an assistant turn; with tool calls, OpenAI's
    shape: a ``tools`` list beside the messages, assistant turns with ``tool_calls`` (content may be empty) and
    ``tool`` turns carrying the results. Calls' arguments (a JSON string or an object) become objects, as chat
    templates write them."""
    tools = row.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(_is_tool(t) for t in tools)):
        raise RowError('tools must be a list of {"type": "function", "function": {"name": ..., "parameters": ...}}')
    out: Messages = []
    for i, turn in enumerate(_turns(row, "messages")):
        if not isinstance(turn, dict):
            raise RowError(f"messages[{i}] must be an object with role and content")
        role, text, calls = turn.get("role"), turn.get("content"), turn.get("tool_calls")
        if role not in KNOWN_ROLES:
            raise RowError(f"messages[{i}].role = {role!r}: unknown role (known: {', '.join(KNOWN_ROLES)})")
        if calls is not None:
            if role != "assistant":
                raise RowError(f"messages[{i}]: only an assistant turn has tool_calls")
            message = {"role": role, "content": text or "", "tool_calls": _calls(calls, i)}
        elif not isinstance(text, str):
            raise RowError(f"messages[{i}].content must be a string")
        else:
            message = {"role": role, "content": text}
        if role == "tool" and turn.get("tool_call_id") is not None:
            message["tool_call_id"] = str(turn["tool_call_id"])
        out.append(message)
    if any(m.get("tool_calls") for m in out) and not tools:
        raise RowError("an assistant turn calls tools but the row lists no tools")
    return Chat(_check_turns(out), tools)


def _is_tool(tool) -> bool:
    function = tool.get("function") if isinstance(tool, dict) else None
    return isinstance(function, dict) and isinstance(function.get("name"), str)


def _calls(calls, i: int) -> list[dict]:
    """A turn's tool calls as chat templates take them (``{"type", "function": {"name", "arguments": {...}}}``)."""
    import json

    if not isinstance(calls, list) or not calls:
        raise RowError(f"messages[{i}].tool_calls must be a non-empty list")
    out = []
    for call in calls:
        function = call.get("function", call) if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        arguments = function.get("arguments", {}) if isinstance(function, dict) else None
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                raise RowError(f"messages[{i}].tool_calls: arguments of {name!r} are not JSON") from None
        if not isinstance(name, str) or not isinstance(arguments, dict):
            raise RowError(f"messages[{i}].tool_calls: each call needs a function name and object arguments")
        entry = {"type": "function", "function": {"name": name, "arguments": arguments}}
        if isinstance(call, dict) and call.get("id") is not None:
            entry["id"] = str(call["id"])
        out.append(entry)
    return out


def parse_sharegpt(row: dict) -> Chat:
    """{"conversations": [{from: human|gpt|system, value}, ...]}."""
    return _parse_turns(row, "conversations", "from", "value", SHAREGPT_ROLES)


def parse_text(row: dict) -> Text:
    text = _text(row, "text")
    if not text.strip():
        raise RowError("empty text")
    return Text(text)


def _int_list(row: dict, key: str) -> list[int]:
    value = row.get(key)
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise RowError(f"field {key!r} must be a list of integers")
    return value


def parse_tokens(row: dict) -> Tokens:
    ids = _int_list(row, "input_ids")
    if not ids:
        raise RowError("empty input_ids")
    labels = _int_list(row, "labels") if row.get("labels") is not None else None
    if labels is not None and len(labels) != len(ids):
        raise RowError(f"labels has {len(labels)} entries but input_ids has {len(ids)}")
    return Tokens(ids, labels)


FORMATS: dict[str, Callable[[dict], Sample]] = {
    "alpaca": parse_alpaca,
    "sharegpt": parse_sharegpt,
    "messages": parse_messages,
    "chatml": parse_messages,
    "text": parse_text,
    "tokenized": parse_tokens,
}
"""Conversation and text formats; preference pairs (``ladle.data.preference.parse_pair``) join them in
``ladle.data.prepare.PARSERS``."""


# First match wins: preference pairs first (a ShareGPT pair also has `conversations`).
DETECTORS: list[tuple[str, Callable[[dict], bool]]] = [
    ("preference", lambda r: "chosen" in r and "rejected" in r),
    ("kto", lambda r: "completion" in r and "label" in r and "prompt" in r),
    ("tokenized", lambda r: "input_ids" in r),
    ("messages", lambda r: "messages" in r),
    ("sharegpt", lambda r: "conversations" in r),
    ("alpaca", lambda r: "instruction" in r and "output" in r),
    ("text", lambda r: "text" in r),
]


def detect_format(row: object) -> str | None:
    """Guess the format from one parsed row; None if no known format matches."""
    if not isinstance(row, dict):
        return None
    return next((name for name, test in DETECTORS if test(row)), None)


def openai_messages(messages: list[dict]) -> list[dict]:
    """A data row's conversation as the OpenAI API takes it: each tool call with an id and its arguments as a JSON
    string, each tool result with the id of the call it answers (data rows may leave both out)."""
    out, pending = [], []
    for message in messages:
        message = dict(message)
        if message.get("tool_calls"):
            calls = []
            for n, call in enumerate(message["tool_calls"]):
                fn = dict(call.get("function", call))
                if not isinstance(fn.get("arguments"), str):
                    fn["arguments"] = json.dumps(fn.get("arguments") or {})
                calls.append({"id": call.get("id") or f"call_{len(out)}_{n}", "type": "function", "function": fn})
            message["tool_calls"], pending = calls, [c["id"] for c in calls]
        elif message.get("role") == "tool" and not message.get("tool_call_id") and pending:
            message["tool_call_id"] = pending.pop(0)
        out.append(message)
    return out
