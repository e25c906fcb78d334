"""Preference pairs (``training.objective: dpo``): the shapes people have, rendered through the chat template into
one row per pair.

Shapes read (one row each):

- ``prompt`` / ``chosen`` / ``rejected`` as strings (TRL's standard form); the prompt may be a message list and
  each side a message list or one turn;
- ``chosen`` / ``rejected`` as whole conversations sharing a prompt prefix: the longest common prefix of turns is
  the prompt, the rest of each is its completion;
- UltraFeedback-binarized's: ``prompt`` as a string (or turns) beside ``chosen`` / ``rejected`` as whole
  conversations that begin with that prompt's turns: the prompt they repeat is the prompt they share;
- HH-RLHF's plain text: ``chosen`` / ``rejected`` as ``"\n\nHuman: ...\n\nAssistant: ..."`` transcripts, read
  into turns, then as whole conversations;
- ShareGPT: ``conversations`` (the prompt) with ``chosen`` / ``rejected`` final turns (``{from, value}``,
  ``{role, content}`` or a string).

A side renders as the template writes ``prompt + side``; its completion is what follows the prompt rendered with
the generation prompt, through the last EOS (what the model must say to end its turn). The prompt and each
completion are tokenized apart, so no token straddles the boundary. Truncation rules, in order: a prompt over
``data.max_prompt_tokens`` keeps its last tokens; a side over ``data.seq_len`` loses the end of its completion
(``data.truncation: drop`` drops the pair instead). Both are counted in the data report.

A pair's row is ``2 x seq_len`` tokens: the chosen side, then the rejected side, each with position ids from 0
(so transformers and ladle's packed attention keep the two apart), then padding. Only completion tokens carry
labels, so the log-probability of a side is the sum over its labelled tokens; chosen and rejected go through one
forward as one batch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ladle.data.formats import SHAREGPT_ROLES, Chat, Messages, RowError
from ladle.data.tokenize import IGNORE, TooLong

ROLE_KEYS = (("role", "content"), ("from", "value"))


@dataclass
class Pair:
    prompt: Messages
    chosen: Messages
    rejected: Messages
    tools: list[dict] | None = None

    def chat(self, side: str = "chosen") -> Chat:
        """The prompt and one side as a conversation (the held-out sample the evaluate stage asks)."""
        return Chat([*self.prompt, *getattr(self, side)], self.tools)


@dataclass
class PairExample:
    """One pair's row: both sides' tokens, labels on the completions, position ids restarting per side."""

    input_ids: list[int]
    labels: list[int]
    positions: list[int]
    prompt_truncated: bool = False
    completion_truncated: bool = False
    label: int | None = None  # kto: 1 desirable, 0 undesirable (its first side); None for a dpo pair

    @property
    def trained(self) -> int:
        return sum(label != IGNORE for label in self.labels)


def _turn(value, where: str) -> dict:
    """One turn: a string (an assistant answer), ``{role, content}`` or ShareGPT's ``{from, value}``."""
    if isinstance(value, str):
        return {"role": "assistant", "content": value}
    if isinstance(value, dict):
        for role_key, text_key in ROLE_KEYS:
            if role_key in value:
                role = SHAREGPT_ROLES.get(value[role_key]) if role_key == "from" else value[role_key]
                text = value.get(text_key)
                if role not in ("system", "user", "assistant", "tool") or not isinstance(text, str):
                    raise RowError(f"{where}: a turn needs a known role and string content")
                return {"role": role, "content": text}
    raise RowError(f"{where} must be a string, a turn {{role, content}} or a list of turns")


def _turns(value, where: str) -> Messages:
    if value is None:
        raise RowError(f"missing field {where!r}")
    if isinstance(value, list):
        if not value:
            raise RowError(f"{where} is empty")
        return [_turn(t, f"{where}[{i}]") for i, t in enumerate(value)]
    return [_turn(value, where)]


def _prompt(value) -> Messages:
    if isinstance(value, str):
        if not value.strip():
            raise RowError("empty prompt")
        return [{"role": "user", "content": value}]
    return _turns(value, "prompt")


def parse_pair(row: dict) -> Pair:
    """One preference row in any of the shapes above, or the reason it cannot be used."""
    for side in ("chosen", "rejected"):
        if row.get(side) is None:
            raise RowError(f"missing field {side!r}: a preference pair needs both chosen and rejected")
    tools = row.get("tools")
    if "prompt" in row or "conversations" in row:
        if "prompt" in row:
            prompt = _prompt(row["prompt"])
        else:
            prompt = _sharegpt(row["conversations"])
        chosen, rejected = _turns(row["chosen"], "chosen"), _turns(row["rejected"], "rejected")
        # UltraFeedback's shape: each side is the whole conversation, the prompt's turns repeated first
        if chosen[: len(prompt)] == prompt and rejected[: len(prompt)] == prompt:
            chosen, rejected = chosen[len(prompt) :], rejected[len(prompt) :]
        for side, turns in (("chosen", chosen), ("rejected", rejected)):
            if turns and turns[0]["role"] != "assistant":
                raise RowError(
                    f"{side} begins with a {turns[0]['role']} turn after the prompt: each side must continue the "
                    "prompt with the assistant's answer. When chosen and rejected are whole conversations, their "
                    "first turns must repeat the prompt exactly (or leave the `prompt` field out)"
                )
    else:
        whole = {}
        for side in ("chosen", "rejected"):
            if isinstance(row[side], str):
                whole[side] = _transcript(row[side], side)
            else:
                whole[side] = _turns(row[side], side)
        shared = 0
        while (
            shared < min(len(whole["chosen"]), len(whole["rejected"])) - 1
            and whole["chosen"][shared] == whole["rejected"][shared]
        ):
            shared += 1
        prompt = whole["chosen"][:shared]
        chosen, rejected = whole["chosen"][shared:], whole["rejected"][shared:]
        if not prompt:
            raise RowError("chosen and rejected share no prompt turn: give a `prompt` field")
    if not any(m["role"] == "user" for m in prompt):
        raise RowError("the prompt has no user turn")
    for side, turns in (("chosen", chosen), ("rejected", rejected)):
        if turns[-1]["role"] != "assistant":
            raise RowError(f"{side}: the last turn must be the assistant's")
        if not "".join(t["content"] for t in turns).strip():
            raise RowError(f"{side} is empty")
    if chosen == rejected:
        raise RowError("chosen equals rejected: the pair prefers nothing")
    return Pair(prompt, chosen, rejected, tools if isinstance(tools, list) else None)


@dataclass
class KtoRow:
    """An unpaired preference (``training.objective: kto``, TRL's ``prompt``/``completion``/``label``): one answer
    to a prompt, judged desirable or not."""

    prompt: Messages
    completion: Messages
    label: bool
    tools: list[dict] | None = None

    def chat(self) -> Chat:
        return Chat([*self.prompt, *self.completion], self.tools)


def parse_kto(row: dict) -> KtoRow:
    """TRL's unpaired preference row: ``prompt`` (a string or turns), ``completion`` (a string, a turn or turns; a
    whole conversation repeating the prompt's turns is cut after them) and ``label`` (true/false, or 1/0)."""
    for key in ("prompt", "completion", "label"):
        if row.get(key) is None:
            raise RowError(f"missing field {key!r}: an unpaired preference needs prompt, completion and label")
    label = row["label"]
    if isinstance(label, bool):
        good = label
    elif isinstance(label, int) and label in (0, 1):
        good = bool(label)
    else:
        raise RowError(f"label = {label!r}: give true or false (desirable or not), or 1 or 0")
    prompt = _prompt(row["prompt"])
    completion = _turns(row["completion"], "completion")
    if completion[: len(prompt)] == prompt and len(completion) > len(prompt):
        completion = completion[len(prompt) :]
    if not any(m["role"] == "user" for m in prompt):
        raise RowError("the prompt has no user turn")
    if completion[0]["role"] != "assistant" or completion[-1]["role"] != "assistant":
        raise RowError("completion: the answer must be the assistant's turn(s), after the prompt")
    if not "".join(t["content"] for t in completion).strip():
        raise RowError("completion is empty")
    tools = row.get("tools")
    return KtoRow(prompt, completion, good, tools if isinstance(tools, list) else None)


def kto_pairs(rows: list[KtoRow]) -> list[Pair]:
    """Each row's completion beside a mismatched one, the KL side: the completion of the row before it (the first
    takes the last's), TRL's rotation by one within a batch. The KL side estimates the KL term of KTO's loss (how
    far the policy moved on answers that are not the prompt's own)."""
    return [Pair(row.prompt, row.completion, rows[i - 1].completion, row.tools) for i, row in enumerate(rows)]


TRANSCRIPT_TURN = re.compile(r"(?:^|\n\n)(Human|Assistant): ")


def _transcript(text: str, side: str) -> Messages:
    """HH-RLHF's plain-text conversation (``"\n\nHuman: ...\n\nAssistant: ..."``) as turns."""
    parts = TRANSCRIPT_TURN.split(text)
    if len(parts) < 3 or parts[0].strip():
        raise RowError(
            f"{side} is a string and the row has no prompt: give a `prompt` field, chosen/rejected as message "
            "lists sharing the prompt's turns, or HH-RLHF's transcript (\n\nHuman: ...\n\nAssistant: ...)"
        )
    roles = {"Human": "user", "Assistant": "assistant"}
    return [{"role": roles[who], "content": said.strip()} for who, said in zip(parts[1::2], parts[2::2], strict=True)]


def _sharegpt(turns) -> Messages:
    if not isinstance(turns, list) or not turns:
        raise RowError("conversations must be a non-empty list of turns")
    return [_turn(t, f"conversations[{i}]") for i, t in enumerate(turns)]


def pair_key(pair: Pair) -> list:
    """What makes a pair the same pair (exact deduplication)."""
    return [pair.prompt, pair.chosen, pair.rejected]


def _render(tokenizer, messages: Messages, tools, prompt: bool) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=prompt)
    except Exception as exc:  # noqa: BLE001 - jinja raises TemplateError, which carries the reason
        raise RowError(f"chat template failed: {exc}") from None


def pair_texts(tokenizer, pair: Pair, allow_equal: bool = False) -> tuple[str, str, str]:
    """The rendered prompt (with the generation prompt) and each side's completion text, through its last EOS.

    Raises:
        RowError: the template is not prefix-stable, or a side does not end its turn with EOS.
    """
    prompt = _render(tokenizer, pair.prompt, pair.tools, prompt=True)
    eos = tokenizer.eos_token or ""
    completions = []
    for side in ("chosen", "rejected"):
        whole = _render(tokenizer, [*pair.prompt, *getattr(pair, side)], pair.tools, prompt=False)
        if not whole.startswith(prompt):
            raise RowError(
                f"the chat template renders the prompt followed by {side} differently from the prompt alone (its "
                "generation prompt is not where the answer starts), so the answer cannot be located; check that "
                f"{side} continues the prompt with one assistant answer"
            )
        cut = whole.rfind(eos, len(prompt)) if eos else -1
        if cut < 0:
            raise RowError(f"{side}: the assistant turn does not end with the EOS token in the chat template")
        completions.append(whole[len(prompt) : cut + len(eos)])
    if completions[0] == completions[1] and not allow_equal:
        raise RowError("chosen equals rejected once rendered: the pair prefers nothing")
    return prompt, completions[0], completions[1]


def tokenize_pairs(
    tokenizer,
    pairs: list[Pair],
    seq_len: int,
    max_prompt: int | None,
    truncation: str,
    labels: list[bool] | None = None,
) -> list[PairExample | RowError]:
    """Each pair's row (``PairExample``), or the reason it cannot be used; one tokenizer call for the batch.
    ``labels``: kto's rows (``kto_pairs``), whose second side (the KL side) may equal the first."""
    out: list[PairExample | RowError | None] = [None] * len(pairs)
    texts, where = [], []
    for i, pair in enumerate(pairs):
        try:
            texts += list(pair_texts(tokenizer, pair, labels is not None))
            where.append(i)
        except RowError as exc:
            out[i] = exc
    if texts:
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
        for j, i in enumerate(where):
            try:
                out[i] = pair_row(
                    ids[3 * j], ids[3 * j + 1], ids[3 * j + 2], seq_len, max_prompt, truncation, labels is not None
                )
                if labels is not None:
                    out[i].label = int(labels[i])
            except RowError as exc:
                out[i] = exc
    return out  # type: ignore[return-value]


def pair_row(
    prompt: list[int],
    chosen: list[int],
    rejected: list[int],
    seq_len: int,
    max_prompt: int | None,
    truncation: str,
    allow_equal: bool = False,
) -> PairExample:
    """Apply the truncation rules and lay both sides out in one row (see the module)."""
    prompt_cut = max_prompt is not None and len(prompt) > max_prompt
    if prompt_cut:
        prompt = prompt[-max_prompt:]
    ids, labels, positions, completion_cut = [], [], [], False
    for side, completion in (("chosen", chosen), ("rejected", rejected)):
        room = seq_len - len(prompt)
        if room <= 0:
            raise RowError(
                f"the prompt's {len(prompt)} tokens leave no room for the {side} completion within "
                f"data.seq_len={seq_len}; raise data.seq_len or set data.max_prompt_tokens"
            )
        if len(completion) > room:
            if truncation == "drop":
                raise TooLong(
                    f"too long: {side} is {len(prompt) + len(completion)} tokens > seq_len={seq_len} "
                    "(data.truncation=drop)"
                )
            completion, completion_cut = completion[:room], True
        ids += prompt + completion
        labels += [IGNORE] * len(prompt) + completion
        positions += list(range(len(prompt) + len(completion)))
    half = len(prompt) + min(len(chosen), seq_len - len(prompt))
    if ids[len(prompt) : half] == ids[half + len(prompt) :] and not allow_equal:
        raise RowError("chosen equals rejected after truncation: the pair prefers nothing")
    return PairExample(ids, labels, positions, prompt_cut, completion_cut)
