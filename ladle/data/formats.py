"""Row formats: each turns one raw row into a sample, or says why it cannot.

A sample is a chat (rendered through the tokenizer's chat template), a plain
text (tokenized as is, closed with EOS), or pre-tokenized ids.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

Messages = list[dict[str, str]]
KNOWN_ROLES = ("system", "user", "assistant")
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
    """{"messages": [{role, content}, ...]} with known roles, ending on an assistant turn."""
    return _parse_turns(row, "messages", "role", "content", {r: r for r in KNOWN_ROLES})


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

# First match wins; preference data is recognised so it can be refused clearly.
DETECTORS: list[tuple[str, Callable[[dict], bool]]] = [
    ("preference", lambda r: "chosen" in r and "rejected" in r),
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
