"""Prepare stage: read rows, apply the chat template, mask labels, pack, store.

The output is content-addressed: ``<output>/datasets/<fingerprint>/`` holds
``train.parquet``, ``eval.parquet``, ``report.json`` and ``manifest.json``, and is
complete only once its marker is written. Re-running with the same inputs finds
it and does no work.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import fsspec
from pydantic import BaseModel, Field

from ladle import storage
from ladle.assets import resolve_data
from ladle.config import DataConfig
from ladle.data.formats import FORMATS, RowError, detect_format
from ladle.data.packing import pack_examples
from ladle.errors import LadleError

# Bump when the prepared bytes would change for the same inputs.
PREP_VERSION = "1"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
IGNORE = -100


class DataReport(BaseModel):
    rows_read: int = Field(description="Non-blank lines read from the sources.")
    rows_used: int = Field(description="Rows turned into training or eval examples.")
    dropped: list[dict] = Field(description='Unusable rows: {"line": N (1-based), "reason": ..., "source": ...}.')
    train_examples: int
    eval_examples: int
    tokens_total: int = Field(description="Real (non-padding) tokens over train and eval.")
    tokens_trained: int = Field(description="Tokens that carry a loss.")
    truncations: int = Field(description="Examples cut to seq_len.")
    train_rows: int = Field(description="Packed training rows of seq_len tokens.")
    eval_rows: int = Field(description="Packed eval rows of seq_len tokens.")
    packing_efficiency: float = Field(description="Real tokens / (rows x seq_len) over the training rows.")
    format: str


class PreparedDataset(BaseModel):
    url: str = Field(description="Folder of the prepared dataset in the artifact store.")
    fingerprint: str
    seq_len: int
    train_rows: int
    eval_rows: int
    report: DataReport


@dataclass
class Example:
    input_ids: list[int]
    labels: list[int]


def fingerprint(cfg: DataConfig, tokenizer_dir: Path) -> str:
    """Hash of everything that decides the prepared bytes.

    Covers the source content, the eval source, the tokenizer files (and so
    its chat template), every data option and the preparation code version.
    """
    digest = hashlib.sha256(f"ladle-prepare/{PREP_VERSION}".encode())
    options = cfg.model_dump(mode="json", exclude={"path", "eval_path"})
    digest.update(json.dumps(options, sort_keys=True).encode())
    for field, path in (("data.path", cfg.path), ("data.eval_path", cfg.eval_path)):
        digest.update(field.encode())
        if path is not None:
            with fsspec.open(resolve_data(path, field), "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    digest.update(block)
    for name in TOKENIZER_FILES:
        file = tokenizer_dir / name
        if file.is_file():
            digest.update(name.encode() + file.read_bytes())
    return digest.hexdigest()[:24]


def iter_rows(url: str) -> Iterator[tuple[int, dict | RowError]]:
    """Yield ``(1-based line, parsed row or RowError)`` for each non-blank JSONL line, streaming."""
    with fsspec.open(url, "rb") as fh:
        for line_no, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                yield line_no, RowError("invalid UTF-8")
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as exc:
                yield line_no, RowError(f"malformed JSON ({exc.msg})")
                continue
            yield line_no, row if isinstance(row, dict) else RowError("a row must be a JSON object")


def check_not_empty(path: str, field: str = "data.path") -> None:
    """Fail fast when a data source holds no non-blank line (reads only up to the first one).

    Raises:
        LadleError: the source is empty.
    """
    with fsspec.open(resolve_data(path, field), "rb") as fh:
        if any(line.strip() for line in fh):
            return
    raise LadleError(f"{field} = {path!r}: the dataset is empty (0 rows). Point it at a JSONL file with rows.")


def render_example(tokenizer, messages: list[dict], train_on: str, seq_len: int) -> tuple[Example, bool]:
    """Tokenize one conversation with the chat template and mask its labels.

    Only assistant turns (content through the closing EOS) are trained when
    ``train_on == "response"``. Returns the example and whether it was truncated.

    Raises:
        RowError: the template does not close assistant turns with EOS, BOS is
            doubled, or nothing trainable survives truncation.
    """
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = _assistant_spans(tokenizer, messages, text) if train_on == "response" else [(0, len(text))]
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    bos = tokenizer.bos_token_id
    if bos is not None and len(ids) > 1 and ids[0] == bos and ids[1] == bos:
        raise RowError("BOS token doubled (template and tokenizer both add it)")
    labels = [tok if any(s <= start < e for s, e in spans) else IGNORE for tok, (start, _) in zip(ids, enc["offset_mapping"])]
    labels[0] = IGNORE  # never predicted; also keeps packed sequences from predicting across a boundary
    truncated = len(ids) > seq_len
    ids, labels = ids[:seq_len], labels[:seq_len]
    if all(label == IGNORE for label in labels):
        raise RowError(f"no trained tokens within seq_len={seq_len}" if truncated else "no trained tokens")
    return Example(ids, labels), truncated


def _assistant_spans(tokenizer, messages: list[dict], text: str) -> list[tuple[int, int]]:
    eos = tokenizer.eos_token
    spans = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = len(tokenizer.apply_chat_template(messages[:k], tokenize=False, add_generation_prompt=True))
        end = len(tokenizer.apply_chat_template(messages[: k + 1], tokenize=False))
        segment = text[start:end]
        if not text.startswith(tokenizer.apply_chat_template(messages[: k + 1], tokenize=False)):
            raise RowError("chat template output is not prefix-stable; cannot locate the response")
        cut = segment.rfind(eos) if eos else -1
        if cut < 0:
            raise RowError("assistant turn does not end with the EOS token in the chat template")
        spans.append((start, start + cut + len(eos)))
    return spans


def collect_examples(url: str, fmt: str, tokenizer, cfg: DataConfig, report: dict) -> list[Example]:
    """Read one source into examples, recording bad rows in ``report``."""
    examples = []
    for line_no, row in iter_rows(url):
        report["rows_read"] += 1
        try:
            if isinstance(row, RowError):
                raise row
            if fmt == "auto":
                fmt = report["format"] = detect_format(row) or "unknown"
            if fmt not in FORMATS:
                raise RowError("row matches no known format (alpaca: instruction/output; messages: [{role, content}])")
            example, truncated = render_example(tokenizer, FORMATS[fmt](row), cfg.train_on, cfg.seq_len)
        except RowError as exc:
            report["dropped"].append({"line": line_no, "reason": str(exc), "source": url})
            continue
        report["truncations"] += int(truncated)
        examples.append(example)
    return examples


def split(examples: list[Example], ratio: float, seed: int) -> tuple[list[Example], list[Example]]:
    """Seeded shuffle, then hold out ``ratio`` of the examples (at least one when ratio > 0)."""
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    n_eval = max(1, round(len(order) * ratio)) if ratio > 0 and len(order) > 1 else 0
    return [examples[i] for i in order[n_eval:]], [examples[i] for i in order[:n_eval]]


def prepare(cfg: DataConfig, tokenizer_dir: Path, output_url: str, on_progress=None) -> PreparedDataset:
    """Prepare (or find already prepared) the dataset for ``cfg``.

    Raises:
        LadleError: a source is missing, too many rows are bad, or nothing is usable.
    """
    fp = fingerprint(cfg, tokenizer_dir)
    url = storage.join(output_url, "datasets", fp)
    if storage.is_complete(url):
        return PreparedDataset.model_validate(storage.read_json(storage.join(url, "manifest.json")))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    if not tokenizer.chat_template:
        raise LadleError(f"base = {str(tokenizer_dir)!r}: the tokenizer has no chat template. Use a chat/instruct tokenizer.")
    report = {"rows_read": 0, "dropped": [], "truncations": 0, "format": cfg.format}
    examples = collect_examples(resolve_data(cfg.path), cfg.format, tokenizer, cfg, report)
    if cfg.eval_path:
        train, _ = split(examples, 0.0, cfg.seed)
        evals = collect_examples(resolve_data(cfg.eval_path, "data.eval_path"), report["format"], tokenizer, cfg, report)
    else:
        train, evals = split(examples, cfg.eval_ratio, cfg.seed)
    check_usable(cfg, report, train)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    train_rows = pack_examples(train, cfg.seq_len, pad, cfg.pack)
    eval_rows = pack_examples(evals, cfg.seq_len, pad, cfg.pack)
    final = build_report(report, train, evals, train_rows, eval_rows, cfg.seq_len)
    storage.write_bytes(storage.join(url, "train.parquet"), train_rows.to_parquet_bytes())
    storage.write_bytes(storage.join(url, "eval.parquet"), eval_rows.to_parquet_bytes())
    storage.write_json(storage.join(url, "report.json"), final.model_dump())
    prepared = PreparedDataset(
        url=url, fingerprint=fp, seq_len=cfg.seq_len, train_rows=len(train_rows), eval_rows=len(eval_rows), report=final
    )
    storage.write_json(storage.join(url, "manifest.json"), prepared.model_dump())
    storage.mark_complete(url)
    return prepared


def check_usable(cfg: DataConfig, report: dict, train: list[Example]) -> None:
    """Fail when nothing is usable or more rows than ``max_bad_fraction`` are bad."""
    read, bad = report["rows_read"], len(report["dropped"])
    first = "; ".join(f"line {d['line']}: {d['reason']}" for d in report["dropped"][:3])
    if read == 0:
        raise LadleError(f"data.path = {cfg.path!r}: the dataset is empty (0 rows). Point it at a JSONL file with rows.")
    if not train:
        raise LadleError(
            f"data.path = {cfg.path!r}: no usable training rows (read {read}, dropped {bad}; {first}). "
            "Fix the rows or data.format."
        )
    if bad / read > cfg.max_bad_fraction:
        raise LadleError(
            f"data.path = {cfg.path!r}: {bad} of {read} rows unusable ({bad / read:.1%} > "
            f"data.max_bad_fraction={cfg.max_bad_fraction}; {first}). Fix the rows or raise data.max_bad_fraction."
        )


def build_report(report: dict, train, evals, train_rows, eval_rows, seq_len: int) -> DataReport:
    every = [*train, *evals]
    return DataReport(
        rows_read=report["rows_read"],
        rows_used=len(every),
        dropped=report["dropped"],
        train_examples=len(train),
        eval_examples=len(evals),
        tokens_total=sum(len(e.input_ids) for e in every),
        tokens_trained=sum(sum(label != IGNORE for label in e.labels) for e in every),
        truncations=report["truncations"],
        train_rows=len(train_rows),
        eval_rows=len(eval_rows),
        packing_efficiency=round(train_rows.real_tokens / max(1, len(train_rows) * seq_len), 4),
        format=report["format"],
    )
