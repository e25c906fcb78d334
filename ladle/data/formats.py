"""Row formats: each turns one raw row into chat messages, or says why it cannot."""

from __future__ import annotations

from typing import Any, Callable

Messages = list[dict[str, str]]
KNOWN_ROLES = ("system", "user", "assistant")


class RowError(ValueError):
    """A row that cannot be used; the message is the reason shown in the data report."""


def _text(row: dict, key: str, required: bool = True) -> str:
    value = row.get(key, "" if not required else None)
    if value is None:
        raise RowError(f"missing field {key!r}")
    if not isinstance(value, str):
        raise RowError(f"field {key!r} must be a string, got {type(value).__name__}")
    return value


def alpaca_to_messages(row: dict) -> Messages:
    """instruction/input/output -> one user turn and one assistant turn."""
    instruction, extra, output = _text(row, "instruction"), _text(row, "input", False), _text(row, "output")
    if not instruction.strip() or not output.strip():
        raise RowError("empty instruction or output")
    prompt = f"{instruction}\n{extra}" if extra.strip() else instruction
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": output}]


def messages_to_messages(row: dict) -> Messages:
    """{"messages": [{role, content}, ...]} with known roles, ending on an assistant turn."""
    turns = row.get("messages")
    if not isinstance(turns, list) or not turns:
        raise RowError("field 'messages' must be a non-empty list")
    out: Messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise RowError(f"messages[{i}] must be an object with role and content")
        role, content = turn.get("role"), turn.get("content")
        if role not in KNOWN_ROLES:
            raise RowError(f"messages[{i}].role = {role!r}: unknown role (known: {', '.join(KNOWN_ROLES)})")
        if not isinstance(content, str):
            raise RowError(f"messages[{i}].content must be a string")
        out.append({"role": role, "content": content})
    if out[-1]["role"] != "assistant":
        raise RowError("the last turn must be the assistant's")
    return out


FORMATS: dict[str, Callable[[dict], Messages]] = {
    "alpaca": alpaca_to_messages,
    "messages": messages_to_messages,
}


def detect_format(row: Any) -> str | None:
    """Guess the format from one parsed row; None if no known format matches."""
    if not isinstance(row, dict):
        return None
    if "messages" in row:
        return "messages"
    if "instruction" in row and "output" in row:
        return "alpaca"
    return None
