"""Prompt rows for online RL (``training.objective: grpo``, ``data.format: prompt``): a ``prompt`` and any other
columns, which the rewards receive (``ladle.rewards``).

The prompt is a string, used as it is (TRL's standard form), or a message list rendered through the chat template
with the assistant's turn opened (TRL's conversational form; ``data.system_prompt`` goes first where it has no
system turn). A prompt longer than ``data.seq_len`` tokens keeps its last ``seq_len`` (the turn the completion
answers stays), or is dropped with ``data.truncation: drop``; both are counted in the report. Rows without a usable
prompt, or with a column that is not JSON, are dropped by line like any other bad row.

Each split is one JSONL shard: ``{"ids": [...], "prompt": <as given>, "columns": {...}}`` per prompt.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

from ladle.config.training import DataConfig
from ladle.data import sources
from ladle.data.formats import RowError
from ladle.data.report import DataReport, LengthHistogram
from ladle.errors import LadleError
from ladle.platform import storage

SHARD = {"train": "prompts-train.jsonl", "eval": "prompts-eval.jsonl"}


@dataclass
class PromptRow:
    """A prompt row as parsed (what ``ladle data inspect`` shows)."""

    prompt: str | list[dict]
    columns: dict


def parse_row(row: dict) -> PromptRow:
    """``parse`` as the other formats' parsers are called (``ladle.data.prepare.PARSERS``).

    Raises:
        RowError: no usable prompt, or a column that is not JSON.
    """
    return PromptRow(*parse(row, None))


def check_format(cfg: DataConfig, files: list[str], field: str = "data.path") -> str:
    """``prompt``, or the error naming ``data.format`` / ``data.path`` and the fix."""
    if cfg.format not in ("auto", "prompt"):
        raise LadleError(
            f"data.format = {cfg.format} with training.objective = grpo: online RL samples completions for prompts; "
            "set data.format=prompt (or auto) and give rows with a `prompt` (a string or a message list)."
        )
    for url in files:
        for _, row in sources.iter_records(url):
            if isinstance(row, dict):
                if "prompt" not in row:
                    raise LadleError(
                        f"{field} = {cfg.path!r}: training.objective = grpo needs rows with a `prompt` (a string "
                        f"or a message list) and the columns the rewards read; the first row has keys "
                        f"{sorted(row)[:8]}. Give prompt rows, or set training.objective=sft."
                    )
                return "prompt"
    return "prompt"


def parse(row: dict, system_prompt: str | None) -> tuple[str | list[dict], dict]:
    """The row's prompt (as given, a system turn added to a message list when set) and its other columns.

    Raises:
        RowError: no usable prompt, or a column that is not JSON.
    """
    prompt = row.get("prompt")
    if isinstance(prompt, str):
        if not prompt.strip():
            raise RowError("empty prompt")
    elif isinstance(prompt, list) and prompt:
        for i, turn in enumerate(prompt):
            if not isinstance(turn, dict) or not isinstance(turn.get("role"), str) or "content" not in turn:
                raise RowError(f"prompt turn {i} is not a {{role, content}} message")
        if prompt[-1]["role"] == "assistant":
            raise RowError("the prompt's last turn is the assistant's; the completion is sampled after the prompt")
        if system_prompt is not None and prompt[0]["role"] != "system":
            prompt = [{"role": "system", "content": system_prompt}, *prompt]
    else:
        raise RowError("missing field 'prompt' (a string or a non-empty message list)")
    columns = {k: v for k, v in row.items() if k != "prompt"}
    try:
        json.dumps(columns)
    except (TypeError, ValueError) as exc:
        raise RowError(f"a column is not JSON ({exc})") from exc
    return prompt, columns


def render(tokenizer, prompt: str | list[dict]) -> list[int]:
    """The prompt's token ids: a string as it is, a message list through the chat template, assistant turn open."""
    if isinstance(prompt, str):
        return tokenizer(prompt, add_special_tokens=True)["input_ids"]
    text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def collect(
    cfg: DataConfig, tokenizer, reward_columns: list[str] | None, items: Iterator
) -> tuple[DataReport, dict[str, list[str]], set[str]]:
    """Read, check and render the prompt rows of both splits: the report, each split's JSONL lines, and the
    columns the rewards read that some row lacks. ``items``: the records (``ladle.data.mix.Item``), each with its
    side of the split and whether the mix uses it.
    ``reward_columns``: the columns the rewards read by name, each checked present; None: a reward takes every
    column (``**kwargs``), and the report names every column the rows have.

    Raises:
        LadleError: nothing usable, or more bad rows than ``data.max_bad_fraction`` (``check_usable``).
    """
    splits: dict[str, list[str]] = {"train": [], "eval": []}
    counts = {"rows_read": 0, "too_long": 0, "truncations": 0, "tokens": 0}
    dropped: list[dict] = []
    hist = LengthHistogram(cfg.seq_len)
    missing_columns: set[str] = set()
    seen_columns: set[str] = set()
    files: dict[str, None] = {}
    for item in items:
        part, first = item.part, item.copy == 0
        files[item.url] = None
        if first:
            counts["rows_read"] += 1
            part.counts["rows_read"] += 1
            part.counts["held_out"] += item.to_eval and part.index >= 0
        try:
            if isinstance(item.row, RowError):
                raise item.row
            prompt, columns = parse(item.row, part.cfg.system_prompt)
            if not item.use:
                part.counts["not_sampled"] += 1
                continue
            ids = render(tokenizer, prompt)
            if len(ids) > cfg.seq_len:
                if cfg.truncation == "drop":
                    counts["too_long"] += first
                    raise RowError(f"prompt of {len(ids)} tokens > data.seq_len={cfg.seq_len}")
                ids, counts["truncations"] = ids[-cfg.seq_len :], counts["truncations"] + first
        except RowError as err:
            if first:
                part.counts["dropped"] += 1
                dropped.append({"line": item.position, "reason": str(err), "source": item.url})
            continue
        missing_columns |= set(reward_columns or ()) - set(columns)
        seen_columns |= set(columns)
        line = json.dumps({"ids": ids, "prompt": prompt, "columns": columns}, ensure_ascii=False)
        splits["eval" if item.to_eval else "train"].append(line)
        part.counts["eval_examples" if item.to_eval else "train_examples"] += 1
        counts["tokens"] += len(ids)
        hist.add(len(ids))
    if not splits["eval"] and cfg.eval_ratio > 0 and len(splits["train"]) > 1:
        splits["eval"].append(splits["train"].pop())  # one held-out prompt at least, as the SFT split keeps
    report = DataReport(
        rows_read=counts["rows_read"],
        rows_used=len(splits["train"]) + len(splits["eval"]),
        dropped=dropped,
        invalid_rows=len(dropped) - counts["too_long"],
        too_long=counts["too_long"],
        train_examples=len(splits["train"]),
        eval_examples=len(splits["eval"]),
        tokens_total=counts["tokens"],
        tokens_trained=0,
        truncations=0,
        prompt_truncations=counts["truncations"],
        train_rows=len(splits["train"]),
        eval_rows=len(splits["eval"]),
        packing_efficiency=0.0,
        format="prompt",
        sources=list(files),
        length_histogram=hist.as_dict(),
        reward_columns=sorted(seen_columns) if reward_columns is None else reward_columns,
    )
    return report, splits, missing_columns


def write(url: str, splits: dict[str, list[str]]) -> dict[str, list[str]]:
    """Each split as one JSONL shard under ``url``; the shards by split."""
    for name, lines in splits.items():
        storage.write_bytes(storage.join(url, SHARD[name]), "".join(line + "\n" for line in lines).encode())
    return {name: [SHARD[name]] for name in splits}


def read_split(dataset_url: str, shards: list[str]) -> list[dict]:
    """A prepared split's prompt rows, in order."""
    rows = []
    for shard in shards:
        text = storage.read_bytes(storage.join(dataset_url, shard)).decode("utf-8")
        rows += [json.loads(line) for line in text.splitlines() if line]
    return rows
