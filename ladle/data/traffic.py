"""Captured traffic into training rows (``ladle data from-traffic``, ``retrain.from_traffic``).

What the server captured (``serve.capture``: each answered request, redacted) and what its users said about the
answers (``POST /v1/feedback``) become rows in the shapes ladle and TRL train on:

- **sft** (``messages``): the conversation with a corrected answer, or with the answer given when it was judged
  good (a thumbs up, or a score at least ``retrain.good_score``) and not cut at ``max_tokens``;
- **dpo** (``preference``, TRL's ``prompt``/``chosen``/``rejected``): a correction (chosen) against the answer it
  corrects (rejected); and, for one prompt answered more than once, an answer judged good against one judged bad;
- **kto** (TRL's unpaired ``prompt``/``completion``/``label``): every judged answer with its label, and every
  correction as a good one (``training.objective: kto``: the natural shape of thumbs up and down);
- **grpo** (``prompt``): every captured chat prompt, which the recipe's rewards score at training time (only where
  the rewards read no column beyond the prompt: traffic carries no reference answers).

Rows are removed, counted by reason in the report, when they repeat one another or a row of the recipe's own data
(the same conversation, pair or prompt after whitespace and case are folded), and when their prompt overlaps the
evaluation set: the recipe's held-out rows, ``data.eval_path`` and ``eval.probe``'s questions, by word n-grams
(``retrain.overlap_ngram``; a prompt shorter than n words overlaps when it equals a held-out prompt). A row that
reached the evaluation set would make the gate score memory, not skill.

Every file is written whole, in a folder named by its rows' digest, so the same traffic gives the same folder and
the same run fingerprint (scheduled retraining skips it), and a new row gives a new one.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from dataclasses import dataclass, field
from datetime import date

from pydantic import BaseModel, Field

from ladle.data import capture_files
from ladle.errors import LadleError

KINDS = ("sft", "dpo", "kto", "grpo")
FORMAT = {"sft": "messages", "dpo": "preference", "kto": "kto", "grpo": "prompt"}
KIND_OF_OBJECTIVE = {"sft": "sft", "dpo": "dpo", "kto": "kto", "grpo": "grpo"}
WORD = re.compile(r"\w+", re.UNICODE)


class TrafficReport(BaseModel):
    """What one curation read, made and dropped (``ladle data from-traffic``; the run's MLflow params)."""

    traffic_url: str
    since: str | None = None
    until: str | None = None
    model: str | None = None
    first_at: str | None = Field(None, description="The oldest captured request used (its time).")
    last_at: str | None = Field(None, description="The newest captured request or feedback used: the window's end.")
    requests: int = 0
    feedback: int = Field(0, description="Feedback records read.")
    with_feedback: int = Field(0, description="Captured requests that have a feedback.")
    feedback_unmatched: int = Field(0, description="Feedback whose answer is not among the captured requests read.")
    rows: dict[str, int] = Field(default_factory=dict)
    new_after: str | None = Field(None, description="new_rows counts rows whose request or feedback is newer.")
    new_rows: dict[str, int] = Field(default_factory=dict)
    dropped: dict[str, int] = Field(default_factory=dict, description="Rows not written, by reason.")
    overlap_examples: list[str] = Field(default_factory=list, description="A few prompts dropped for eval overlap.")
    folder: str | None = None
    files: dict[str, str] = Field(default_factory=dict)
    sources: list[dict] = Field(
        default_factory=list, description="data.sources entries of the recipe's objective, ready to add."
    )


@dataclass
class Row:
    kind: str
    row: dict
    key: str  # what makes it a duplicate
    prompt_text: str  # the prompt's user turns, for the eval-overlap check
    at: str  # the newest of its request's and feedback's times


@dataclass
class Curation:
    rows: dict[str, list[Row]] = field(default_factory=lambda: {k: [] for k in KINDS})
    dropped: Counter = field(default_factory=Counter)


def fold(text: str) -> str:
    return " ".join(text.split()).lower()


def conversation_key(messages: list[dict], *extra: str) -> str:
    """The duplicate key of a conversation: its non-system turns, whitespace and case folded."""
    turns = [
        f"{m.get('role')}:{fold(content_text(m.get('content')))}:{json.dumps(m.get('tool_calls'), sort_keys=True)}"
        for m in messages
        if m.get("role") != "system"
    ]
    return hashlib.sha256("\x1e".join([*turns, *extra]).encode()).hexdigest()


def content_text(content) -> str:
    """A message's text: a string, or OpenAI's content parts' text joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def user_text(prompt) -> str:
    if isinstance(prompt, str):
        return prompt
    return "\n".join(content_text(m.get("content")) for m in prompt if m.get("role") == "user")


def is_good(value, good_score: float) -> bool:
    return bool(value) if isinstance(value, bool) else float(value) >= good_score


def in_window(path: str, since: date | None, until: date | None) -> bool:
    day = next((part[5:] for part in path.split("/") if part.startswith("date=")), "")
    try:
        d = date.fromisoformat(day)
    except ValueError:
        return False
    return (since is None or d >= since) and (until is None or d <= until)


def read(url: str, kind: str, since: date | None, until: date | None, model: str | None, dropped: Counter):
    """The records of ``kind`` in the window (and of ``model``), oldest first; lines that do not parse counted."""
    wanted = f"model={capture_files.safe(model)}" if model else None
    for path in capture_files.part_files(url, kind):
        if not in_window(path, since, until) or (wanted and wanted not in path.split("/")):
            continue
        for line in capture_files.file_lines(url, path):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                dropped["unreadable line"] += 1
                continue
            if isinstance(record, dict):
                yield record


@dataclass
class Judged:
    """One captured chat answer with its (latest) feedback."""

    prompt: list[dict]
    tools: list | None
    given: dict  # the answer as an assistant message
    good: bool
    correction: str | None
    cut: bool  # ended at max_tokens
    at: str

    def row(self, kind: str, row: dict, *key: str) -> Row:
        extra = {"tools": self.tools} if self.tools else {}
        return Row(kind, {**row, **extra}, conversation_key(self.prompt, *key), user_text(self.prompt), self.at)


def judged_rows(j: Judged, dropped: Counter) -> list[Row]:
    """The sft, kto and dpo rows one judged answer gives (a correction: chosen, against the answer given)."""
    prompt, given = j.prompt, j.given
    if j.correction is not None:
        fixed = {"role": "assistant", "content": j.correction}
        rows = [
            j.row("sft", {"messages": [*prompt, fixed]}, "sft", json.dumps(fixed)),
            j.row("kto", {"prompt": prompt, "completion": [fixed], "label": True}, "kto", json.dumps(fixed), "1"),
        ]
        if fold(j.correction) != fold(given["content"]) or given.get("tool_calls"):
            pair = {"prompt": prompt, "chosen": [fixed], "rejected": [given]}
            rows.append(j.row("dpo", pair, "dpo", json.dumps([fixed, given])))
    elif j.good and j.cut:
        dropped["sft: a good answer cut at max_tokens"] += 1
        rows = []
    else:
        rows = [j.row("sft", {"messages": [*prompt, given]}, "sft", json.dumps(given))] if j.good else []
    label = {"prompt": prompt, "completion": [given], "label": j.good}
    return [*rows, j.row("kto", label, "kto", json.dumps(given), str(int(j.good)))]


def judged(record: dict, prompt: list[dict], tools, feedback: dict, good_score: float) -> Judged:
    answer = record.get("answer") or {}
    given = {"role": "assistant", "content": answer.get("content") or ""}
    if answer.get("tool_calls"):
        given["tool_calls"] = answer["tool_calls"]
    correction = feedback.get("correction")
    return Judged(
        prompt,
        tools,
        given,
        is_good(feedback["value"], good_score),
        correction if isinstance(correction, str) and correction.strip() else None,
        record.get("finish_reason") == "length",
        max(record.get("at", ""), feedback.get("at", "")),
    )


def curate_records(captures, feedback: dict[str, dict], good_score: float, grpo: bool) -> Curation:
    """The rows of every kind from ``captures`` (an iterable, read once) and the latest ``feedback`` per response
    id."""
    out = Curation()
    by_prompt: dict[str, list[Judged]] = {}  # prompt key -> its judged answers without a correction
    for record in captures:
        request = record.get("request") or {}
        prompt = request.get("messages") if record.get("route") == "chat" else request.get("prompt")
        if not prompt or not isinstance(prompt, list | str):
            out.dropped["request without messages or prompt"] += 1
            continue
        tools = request.get("tools")
        pkey = conversation_key(prompt, json.dumps(tools, sort_keys=True)) if isinstance(prompt, list) else fold(prompt)
        if grpo:
            out.rows["grpo"].append(Row("grpo", {"prompt": prompt}, pkey, user_text(prompt), record.get("at", "")))
        said = feedback.get(record.get("id", ""))
        if said is None:
            continue
        if not isinstance(prompt, list):
            out.dropped["a text completion (no conversation) with feedback: only its prompt is used"] += 1
            continue
        j = judged(record, prompt, tools, said, good_score)
        for row in judged_rows(j, out.dropped):
            out.rows[row.kind].append(row)
        if j.correction is None:
            by_prompt.setdefault(pkey, []).append(j)
    for answers in by_prompt.values():  # one prompt answered twice or more: each good answer against a bad one
        goods, bads = [a for a in answers if a.good], [a for a in answers if not a.good]
        for good, bad in zip(goods, bads, strict=False):
            if fold(good.given["content"]) != fold(bad.given["content"]):
                pair = {"prompt": good.prompt, "chosen": [good.given], "rejected": [bad.given]}
                row = good.row("dpo", pair, "dpo", json.dumps([good.given, bad.given]))
                row.at = max(good.at, bad.at)
                out.rows["dpo"].append(row)
    return out


def ngrams(text: str, n: int) -> set[tuple[str, ...]]:
    words = WORD.findall(text.lower())
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


class Overlap:
    """The evaluation set's prompts as word n-grams (and whole, for the short ones)."""

    def __init__(self, texts: list[str], n: int):
        self.n = n
        self.grams: set[tuple[str, ...]] = set()
        self.short: set[tuple[str, ...]] = set()
        for text in texts:
            words = tuple(WORD.findall(text.lower()))
            if len(words) < n:
                self.short.add(words)
            self.grams |= ngrams(text, n)

    def hits(self, text: str) -> bool:
        words = tuple(WORD.findall(text.lower()))
        if len(words) < self.n:
            return words in self.short
        return not self.grams.isdisjoint(ngrams(text, self.n))


@dataclass
class RecipeData:
    """What the recipe's own data says about traffic rows: the keys they must not repeat, the held-out prompts."""

    keys: dict[str, set[str]] = field(default_factory=lambda: {k: set() for k in KINDS})
    eval_texts: list[str] = field(default_factory=list)


def recipe_data(cfg) -> RecipeData:
    """The recipe's rows' duplicate keys (training side) and its evaluation prompts (held-out rows,
    ``data.eval_path``, ``eval.probe``), read as the prepare stage reads them."""
    from ladle.data import mix
    from ladle.data.formats import Chat
    from ladle.data.preference import Pair
    from ladle.data.prepare import eval_items, eval_part, parse_item, resolve_parts
    from ladle.data.prompts import PromptRow

    out = RecipeData()
    objective = cfg.training.objective
    found = resolve_parts(cfg.data, objective)
    held = eval_part(cfg.data, objective, None if cfg.data.sources else found[0].fmt)
    items = [item for part in found for item in mix.part_items(cfg.data, part) if item.copy == 0]
    for item in [*items, *eval_items(held)]:
        sample = parse_item(item)
        if isinstance(sample, Chat):
            prompt = sample.messages[:-1]
            out.keys["sft"].add(conversation_key(sample.messages[:-1], "sft", json.dumps(sample.messages[-1])))
        elif isinstance(sample, Pair):
            prompt = sample.prompt
            chosen, rejected = sample.chosen, sample.rejected
            out.keys["dpo"].add(conversation_key(prompt, "dpo", json.dumps([*chosen, *rejected])))
        elif isinstance(sample, PromptRow):
            prompt = sample.prompt
        else:
            continue
        tools_key = json.dumps(getattr(sample, "tools", None), sort_keys=True)
        if isinstance(prompt, list):
            out.keys["grpo"].add(conversation_key(prompt, tools_key))
        else:
            out.keys["grpo"].add(fold(prompt))
        if item.to_eval:
            out.eval_texts.append(user_text(prompt))
    if cfg.eval.probe:
        from ladle.data.probe import load_probe

        out.eval_texts += [q["question"] for q in load_probe(cfg.eval.probe)]
    return out


def filter_rows(curation: Curation, recipe: RecipeData, overlap: Overlap) -> list[str]:
    """Drop, in place, duplicates (within traffic, then of the recipe's rows) and eval-overlapping rows; returns a
    few overlapping prompts for the report."""
    examples: list[str] = []
    for kind, rows in curation.rows.items():
        kept, seen = [], set()
        for row in rows:
            if row.key in seen:
                curation.dropped[f"{kind}: repeats another traffic row"] += 1
            elif row.key in recipe.keys[kind]:
                curation.dropped[f"{kind}: already in the recipe's data"] += 1
            elif overlap.hits(row.prompt_text):
                curation.dropped[f"{kind}: prompt overlaps the evaluation set"] += 1
                if len(examples) < 5 and row.prompt_text[:200] not in examples:
                    examples.append(row.prompt_text[:200])
            else:
                kept.append(row)
            seen.add(row.key)
        curation.rows[kind] = kept
    return examples


def curate(
    cfg,
    traffic_url: str | None = None,
    since: date | None = None,
    until: date | None = None,
    model: str | None = None,
    out: str | None = None,
    new_after: str | None = None,
    reward_columns: list[str] | None = None,
    empty_ok: bool = False,
) -> TrafficReport:
    """Read the captured traffic of ``cfg`` (a loaded recipe) in the window, write its rows of every kind and say
    what was made and dropped.

    Args:
        traffic_url: where the server captured to; None: ``retrain.traffic_url``, else ``serve.capture.url``, else
            the recipe's ``output``/traffic.
        out: the folder the rows go to; None: ``output``/traffic-data/<digest of the rows>.
        new_after: a capture or feedback time (ISO); rows with anything newer are counted in ``new_rows``.
        reward_columns: grpo: the columns the recipe's rewards read (``ladle.rewards.columns_needed``); traffic
            carries only the prompt, so rewards that read more get no grpo rows (said in the report).
        empty_ok: no captured request is an empty report (a scheduled run before the server heard anything), not an
            error.

    Raises:
        LadleError: no captured request in the window (naming the folder and the window), or the recipe's data
            cannot be read.
    """
    from ladle.platform import storage

    settings = cfg.retrain
    url = storage.normalise(traffic_url or settings.traffic_url or cfg.serve.capture.url or f"{cfg.output}/traffic")
    since = since or settings.since
    report = TrafficReport(
        traffic_url=url, since=since and since.isoformat(), until=until and until.isoformat(), model=model
    )
    dropped: Counter = Counter()
    feedback: dict[str, dict] = {}  # smaller than the captures: held whole; the captures stream past
    for record in read(url, "feedback", since, until, None, dropped):
        report.feedback += 1
        if isinstance(record.get("response_id"), str) and "value" in record:
            feedback[record["response_id"]] = record  # files oldest first: the last one wins
    matched: set[str] = set()
    times: list[str] = []

    def counted(records):
        for record in records:
            report.requests += 1
            at = record.get("at", "")
            said = feedback.get(record.get("id", ""))
            if said is not None:
                matched.add(record["id"])
                at = max(at, said.get("at", ""))
            times[:] = [min([record.get("at", ""), *times[:1]]), max([at, *times[1:]])]
            yield record

    needed = [c for c in reward_columns or [] if c != "prompt"]
    grpo_ok = not (cfg.training.objective == "grpo" and needed)
    curation = curate_records(
        counted(read(url, "captures", since, until, model, dropped)), feedback, settings.good_score, grpo_ok
    )
    if not report.requests:
        if empty_ok:
            return report
        window = f" from {since}" if since else ""
        window += f" to {until}" if until else ""
        raise LadleError(
            f"no captured request under {url}/captures{window}{f' for model {model}' if model else ''}. Serve with "
            "serve.capture.enabled=true (and send requests), or point --traffic (retrain.traffic_url) at the folder "
            "the server captured to."
        )
    report.with_feedback, report.feedback_unmatched = len(matched), len(feedback) - len(matched)
    report.first_at, report.last_at = times[0] or None, times[1] or None
    if not grpo_ok:
        dropped[f"grpo: the rewards read {', '.join(needed)}, which traffic does not carry"] += report.requests
    curation.dropped.update(dropped)
    recipe = recipe_data(cfg)
    report.overlap_examples = filter_rows(curation, recipe, Overlap(recipe.eval_texts, settings.overlap_ngram))
    report.dropped = dict(sorted(curation.dropped.items()))
    report.rows = {kind: len(rows) for kind, rows in curation.rows.items()}
    report.new_after = new_after
    report.new_rows = {
        kind: sum(1 for r in rows if new_after is None or r.at > new_after) for kind, rows in curation.rows.items()
    }
    write(cfg, curation, report, out)
    return report


def write(cfg, curation: Curation, report: TrafficReport, out: str | None) -> None:
    from ladle.platform import storage

    blobs = {
        kind: "".join(json.dumps(r.row, ensure_ascii=False, sort_keys=True) + "\n" for r in rows).encode()
        for kind, rows in curation.rows.items()
        if rows
    }
    digest = hashlib.sha256()
    for kind in sorted(blobs):
        digest.update(kind.encode() + b"\0" + blobs[kind])
    folder = out or storage.join(cfg.output, "traffic-data", digest.hexdigest()[:16])
    report.folder = folder
    for kind, blob in blobs.items():
        path = storage.join(folder, f"{kind}.jsonl")
        storage.write_bytes(path, blob)
        report.files[kind] = path
    kind = KIND_OF_OBJECTIVE.get(cfg.training.objective)
    if kind in report.files:
        report.sources = [
            {
                "path": report.files[kind],
                "name": f"traffic-{kind}",
                "format": FORMAT[kind],
                "epochs": cfg.retrain.traffic_epochs,
            }
        ]
    storage.write_json(storage.join(folder, "report.json"), report.model_dump())
    times = {kind: sorted(r.at for r in rows) for kind, rows in curation.rows.items() if rows}
    storage.write_json(storage.join(folder, "times.json"), times)


def count_new(folder: str | None, kind: str, after: str | None) -> int:
    """The rows of ``kind`` in a curation's ``folder`` whose request or feedback is newer than ``after`` (all of them
    for None): what a scheduled run weighs against ``retrain.min_new_feedback``."""
    from ladle.platform import storage

    if folder is None:
        return 0
    try:
        times = storage.read_json(storage.join(folder, "times.json")).get(kind, [])
    except FileNotFoundError:
        return 0
    return sum(1 for at in times if after is None or at > after)
