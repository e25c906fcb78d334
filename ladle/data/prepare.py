"""Prepare stage: read records, apply the chat template, mask labels, pack, store.

The output is content-addressed: ``<output>/datasets/<fingerprint>/`` holds
Parquet shards per split, ``report.json``, ``length_histogram.png`` and
``manifest.json``, and is complete only once its marker is written. Re-running
with the same inputs finds it and does no work. Records stream through in
batches; memory is bounded by the packing window, not by the file size.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from pydantic import BaseModel, Field

from ladle.config import DataConfig
from ladle.config.training import DataSource
from ladle.data import mix, sources
from ladle.data.formats import FORMATS, Chat, RowError, Sample, Text, detect_format
from ladle.data.packing import SplitWriter
from ladle.data.preference import KtoRow, Pair, PairExample, kto_pairs, pair_key, parse_kto, parse_pair, tokenize_pairs
from ladle.data.prompts import parse_row as parse_prompt_row
from ladle.data.report import DataReport, LengthHistogram, histogram_png
from ladle.data.tokenize import IGNORE, Example, TooLong, tokenize_batch
from ladle.errors import LadleError
from ladle.platform import storage

# Bump when the prepared bytes would change for the same inputs.
PREP_VERSION = "3"  # 3: held-out eval samples kept for the evaluate stage
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
BATCH = 512
# Held-out conversations kept verbatim for the evaluate stage (exact match of greedy answers).
EVAL_SAMPLES_MAX = 1000

PARSERS = {**FORMATS, "preference": parse_pair, "kto": parse_kto, "prompt": parse_prompt_row}
PAIR_FORMAT = {"dpo": "preference", "kto": "kto"}
"""The objectives that train on two-sided rows (``ladle.data.preference``), and the format each reads."""
"""Every ``data.format`` but ``auto``, by name: one row into a sample (a pair for ``preference``)."""

__all__ = ["IGNORE", "Example", "PreparedDataset", "prepare", "fingerprint", "check_not_empty", "iter_samples"]


class PreparedDataset(BaseModel):
    url: str = Field(description="Folder of the prepared dataset in the artifact store.")
    fingerprint: str
    seq_len: int
    train_rows: int
    eval_rows: int
    shards: dict[str, list[str]] = Field(description="Parquet shard file names per split, in order.")
    report: DataReport
    eval_samples: str | None = Field(
        None, description="JSONL of held-out conversations (messages) for the evaluate stage; null when none."
    )


def fingerprint(cfg: DataConfig, tokenizer_dir: Path, objective: str = "sft") -> str:
    """Hash of everything that decides the prepared bytes.

    Covers each source file's content (or its ETag on object stores), the
    tokenizer files (and so its chat template), every data option and the
    preparation code version.
    """
    digest = hashlib.sha256(f"ladle-prepare/{PREP_VERSION}".encode())
    options = cfg.model_dump(mode="json", exclude={"path", "eval_path", "sources"})
    digest.update(json.dumps(options, sort_keys=True).encode())
    if objective != "sft":  # (an SFT set's fingerprint stays what it was before objectives existed)
        digest.update(f"objective:{objective}".encode())
    paths: tuple[tuple[str, str | None], ...] = (("data.path", cfg.path), ("data.eval_path", cfg.eval_path))
    if cfg.sources:  # (a one-source set's fingerprint stays what it was before sources existed)
        mix.fingerprint_parts(cfg, digest)
        paths = paths[1:]
    for field, path in paths:
        digest.update(field.encode())
        for url in sources.expand(path, field) if path else []:
            digest.update(f"{Path(url).suffix}:{sources.signature(url)}".encode())
    for name in TOKENIZER_FILES:
        file = tokenizer_dir / name
        if file.is_file():
            digest.update(name.encode() + file.read_bytes())
    return digest.hexdigest()[:24]


def check_not_empty(path: str, field: str = "data.path") -> None:
    """Fail fast when the sources hold no record (reads only up to the first one).

    Raises:
        LadleError: nothing there, or no record in any matched file.
    """
    for url in sources.expand(path, field):
        if next(iter(sources.iter_records(url)), None) is not None:
            return
    raise LadleError(f"{field} = {path!r}: the dataset is empty (0 rows). Point it at a file with rows.")


def resolve_format(cfg: DataConfig, files: list[str], objective: str = "sft", field: str = "data.path") -> str:
    """The declared format, or the one detected from the first parseable record; checked against the objective.
    ``field``: how errors name the files (``data.path``, or a source's ``data.sources[i].path``).

    Raises:
        LadleError: preference pairs for SFT, other rows for DPO, or auto-detection finds no known format.
    """
    if objective == "grpo":
        from ladle.data.prompts import check_format

        return check_format(cfg, files, field)
    wanted = PAIR_FORMAT.get(objective)
    if cfg.format != "auto" and wanted is not None and cfg.format != wanted:
        raise LadleError(
            f"data.format = {cfg.format} with training.objective = {objective}: it reads "
            + ("chosen/rejected pairs" if wanted == "preference" else "prompt/completion/label rows")
            + f"; set data.format={wanted} (or auto)"
        )
    if cfg.format != "auto" and wanted is None and cfg.format in PAIR_FORMAT.values():
        trains = next(o for o, f in PAIR_FORMAT.items() if f == cfg.format)
        raise LadleError(
            f"data.format = {cfg.format} with training.objective = {objective}: those rows train with "
            f"training.objective={trains}; set it, or data.format to your rows' format"
        )
    for url in files:
        for _, row in sources.iter_records(url):
            if isinstance(row, RowError):
                continue
            found = detect_format(row)
            if found in PAIR_FORMAT.values() and wanted is None:
                trains = next(o for o, f in PAIR_FORMAT.items() if f == found)
                shape = (
                    "preference pairs (chosen/rejected)"
                    if found == "preference"
                    else "unpaired preferences (completion/label)"
                )
                raise LadleError(
                    f"{field} = {cfg.path!r}: rows are {shape} and training.objective = {objective}. Set "
                    f"training.objective={trains} to tune on them, or use instruction, chat or text data."
                )
            if wanted is not None and found != wanted:
                shape = (
                    "preference pairs (chosen and rejected in each row)"
                    if wanted == "preference"
                    else ("unpaired preferences (prompt, completion and label in each row)")
                )
                raise LadleError(
                    f"{field} = {cfg.path!r}: training.objective = {objective} needs {shape}, but the first record "
                    f"of {url!r} is {found or 'of no known format'} (keys: {sorted(row)[:8]}). Give such rows, or "
                    "set training.objective=sft."
                )
            if cfg.format != "auto":
                return cfg.format
            if found is None:
                raise LadleError(
                    f"data.format = auto: the first record of {url!r} matches no known format (keys: "
                    f"{sorted(row)[:8]}). Set data.format to one of {', '.join(PARSERS)}."
                )
            return found
    if cfg.format != "auto":
        return cfg.format
    return wanted or "alpaca"


def iter_samples(files: list[str], fmt: str, state: dict) -> Iterator[tuple[str, int, int, Sample | RowError, object]]:
    """``(source, file index, position, sample or RowError, raw row)`` over all files; counts records in ``state``.

    The raw row is the record as read (a dict), or the line's text when it could not be decoded.
    """
    parse = PARSERS[fmt]
    for file_index, url in enumerate(files):
        for position, row in sources.iter_records(url):
            state["rows_read"] += 1
            if isinstance(row, RowError):
                yield url, file_index, position, row, getattr(row, "raw", None)
                continue
            try:
                yield url, file_index, position, parse(row), row
            except RowError as exc:
                yield url, file_index, position, exc, row


def _batched(items, size: int):
    batch = []
    for item in items:
        batch.append(item)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


def sample_key(sample: Sample | Pair) -> bytes:
    """Identity of a sample for exact deduplication."""
    body = (
        pair_key(sample)
        if isinstance(sample, Pair)
        else [sample.prompt, sample.completion, sample.label]
        if isinstance(sample, KtoRow)
        else sample.messages
        if isinstance(sample, Chat)
        else sample.text
        if isinstance(sample, Text)
        else [sample.input_ids, sample.labels]
    )
    return hashlib.blake2b(json.dumps(body, sort_keys=True).encode(), digest_size=16).digest()


class Collector:
    """Routes examples to the train/eval writers and keeps the report's counters."""

    def __init__(self, cfg: DataConfig, url: str, pad: int, pairs: bool = False):
        self.cfg, self.pairs = cfg, pairs
        # A preference pair is one row of both sides (2 x seq_len), never packed with another pair.
        row = 2 * cfg.seq_len if pairs else cfg.seq_len
        self.train = SplitWriter(url, "train", row, pad, cfg.pack and not pairs)
        self.eval = SplitWriter(url, "eval", row, pad, cfg.pack and not pairs)
        self.hist = LengthHistogram(row)
        self.counts = {
            "rows_read": 0,
            "truncations": 0,
            "too_long": 0,
            "duplicates_removed": 0,
            "tokens_total": 0,
            "tokens_trained": 0,
            "prompt_truncations": 0,
            "completion_truncations": 0,
        }
        self.dropped: list[dict] = []
        # Every dropped row with its raw text, spooled to disk past 8 MiB: written as rejects.jsonl.
        self.rejects = tempfile.SpooledTemporaryFile(max_size=8 << 20, mode="w+b")  # noqa: SIM115 (lives with the collector)
        self.eval_samples: list[dict] = []
        self.seen: set[bytes] = set()
        self.reserve: Example | None = None  # guarantees one eval example on tiny data
        self.reserve_sample: Sample | None = None

    def drop(self, part: mix.Part, source: str, position: int, err: RowError, raw: object = None) -> None:
        part.counts["dropped"] += 1
        self.dropped.append({"line": position, "reason": str(err), "source": source})
        line = {
            "source": source,
            "line": position,
            "reason": str(err),
            "raw": raw if isinstance(raw, str) else json.dumps(raw, default=str),
        }
        self.rejects.write((json.dumps(line, ensure_ascii=False) + "\n").encode())
        if isinstance(err, TooLong):
            self.counts["too_long"] += 1

    def keep_eval_sample(self, sample: Sample | Pair | None) -> None:
        """Keep a held-out conversation whose last turn is the assistant's (its reference answer): a pair's
        prompt with its chosen side."""
        if isinstance(sample, Pair):
            sample = sample.chat("chosen")
        if isinstance(sample, KtoRow):  # a desirable answer is a reference; an undesirable one is not
            sample = sample.chat() if sample.label else None
        if (
            isinstance(sample, Chat)
            and sample.messages[-1]["role"] == "assistant"
            and len(self.eval_samples) < EVAL_SAMPLES_MAX
        ):
            self.eval_samples.append({"messages": sample.messages})

    def duplicate(self, sample: Sample, copy: int = 0) -> bool:
        """Whether ``sample`` repeats an earlier one (``data.dedup``); a pass the mix repeats is compared with
        its own pass, so the repeat of a kept row is kept and the repeat of a duplicate is not."""
        if not self.cfg.dedup:
            return False
        key = sample_key(sample) + copy.to_bytes(4, "big")
        if key in self.seen:
            self.counts["duplicates_removed"] += copy == 0
            return True
        self.seen.add(key)
        return False

    def add(self, example: Example | PairExample, truncated: bool, to_eval: bool, sample=None, part=None) -> None:
        if part is not None:
            part.counts["eval_examples" if to_eval else "train_examples"] += 1
            part.counts["tokens_trained"] += 0 if to_eval else example.trained
        self.counts["truncations"] += int(truncated)
        if isinstance(example, PairExample):
            self.counts["prompt_truncations"] += int(example.prompt_truncated)
            self.counts["completion_truncations"] += int(example.completion_truncated)
        self.counts["tokens_total"] += len(example.input_ids)
        self.counts["tokens_trained"] += example.trained
        self.hist.add(len(example.input_ids))
        if to_eval:
            self.eval.add(example)
            self.keep_eval_sample(None if truncated else sample)
        elif self.reserve is None and self.cfg.eval_ratio > 0 and not self.cfg.eval_path:
            self.reserve, self.reserve_sample = example, sample
        else:
            self.train.add(example)

    def finish(self) -> None:
        if self.reserve is not None:
            to_eval = self.eval.examples == 0
            (self.eval if to_eval else self.train).add(self.reserve)
            if to_eval:
                self.keep_eval_sample(self.reserve_sample)
        self.train.close()
        self.eval.close()


def with_system(sample: Sample | Pair, prompt: str | None) -> Sample | Pair:
    """``sample`` with ``data.system_prompt`` as its first turn when it is a conversation without one."""
    if isinstance(sample, KtoRow):
        if prompt is None or sample.prompt[0]["role"] == "system":
            return sample
        system = [{"role": "system", "content": prompt}]
        return KtoRow([*system, *sample.prompt], sample.completion, sample.label, sample.tools)
    if isinstance(sample, Pair):
        if prompt is None or sample.prompt[0]["role"] == "system":
            return sample
        return Pair(
            [{"role": "system", "content": prompt}, *sample.prompt], sample.chosen, sample.rejected, sample.tools
        )
    if prompt is None or not isinstance(sample, Chat) or sample.messages[0]["role"] == "system":
        return sample
    return Chat([{"role": "system", "content": prompt}, *sample.messages])


def tokenize_samples(tokenizer, samples: list, cfg: DataConfig, pairs: bool) -> list[tuple]:
    """``(example or RowError, truncated)`` per sample: conversations as training rows, or preference pairs as
    one row each (``ladle.data.preference``)."""
    if not pairs:
        return tokenize_batch(tokenizer, samples, cfg.train_on, cfg.seq_len, cfg.truncation)
    labels = None
    if samples and isinstance(samples[0], KtoRow):  # kto: each answer beside a mismatched one (its KL side)
        labels, samples = [row.label for row in samples], kto_pairs(samples)
    rows = tokenize_pairs(tokenizer, samples, cfg.seq_len, cfg.max_prompt_tokens, cfg.truncation, labels)
    return [(r, not isinstance(r, RowError) and (r.prompt_truncated or r.completion_truncated)) for r in rows]


def parse_item(item: mix.Item) -> Sample | Pair | RowError:
    """The item's record in its source's format, or the reason it is unusable."""
    if isinstance(item.row, RowError):
        return item.row
    try:
        return PARSERS[item.part.fmt](item.row)
    except RowError as exc:
        return exc


def consume(collector: Collector, tokenizer, items: Iterator[mix.Item], on_progress) -> None:
    """Stream ``items`` through parsing, dedup, tokenization (each source with its own options) and into the
    writers. A record repeated by the mix reports its problems once, in its first pass."""
    for batch in _batched(items, BATCH):
        good = []
        for item in batch:
            part, first = item.part, item.copy == 0
            if first:
                collector.counts["rows_read"] += 1
                part.counts["rows_read"] += 1
                part.counts["held_out"] += item.to_eval and part.index >= 0
            sample = parse_item(item)
            raw = getattr(item.row, "raw", None) if isinstance(item.row, RowError) else item.row
            if isinstance(sample, RowError):
                if first:
                    collector.drop(part, item.url, item.position, sample, raw)
                continue
            if not item.use:
                part.counts["not_sampled"] += 1
                continue
            if not collector.duplicate(sample := with_system(sample, part.cfg.system_prompt), item.copy):
                good.append((item, sample, raw))
        results: list = [None] * len(good)
        by_part: dict[int, list[int]] = {}
        for j, (item, _, _) in enumerate(good):
            by_part.setdefault(item.part.index, []).append(j)
        for indices in by_part.values():
            part_cfg = good[indices[0]][0].part.cfg
            done = tokenize_samples(tokenizer, [good[j][1] for j in indices], part_cfg, collector.pairs)
            for j, result in zip(indices, done, strict=True):
                results[j] = result
        for (item, sample, raw), (example, truncated) in zip(good, results, strict=True):
            if isinstance(example, RowError):
                if item.copy == 0:
                    collector.drop(item.part, item.url, item.position, example, raw)
                continue
            collector.add(example, truncated, item.to_eval, sample, item.part)
        if on_progress:
            on_progress(collector.counts["rows_read"])


def eval_part(cfg: DataConfig, objective: str, fmt: str | None) -> mix.Part | None:
    """``data.eval_path`` as a source of held-out rows only (its format: the one source's, or its own)."""
    if not cfg.eval_path:
        return None
    files = sources.expand(cfg.eval_path, "data.eval_path")
    spec = DataSource(path=cfg.eval_path)
    part = mix.Part(-1, spec, "data.eval_path", mix.view(cfg, spec), files)
    part.fmt = fmt or resolve_format(part.cfg, files, objective, "data.eval_path")
    return part


def eval_items(part: mix.Part | None) -> Iterator[mix.Item]:
    for url in part.files if part else []:
        for position, row in sources.iter_records(url):
            yield mix.Item(part, url, position, row, True, True, 0)


def resolve_parts(cfg: DataConfig, objective: str) -> list[mix.Part]:
    """The sources with their formats resolved and checked against the objective, and their targets set
    (``ladle.data.mix``)."""
    found = mix.parts(cfg)
    for part in found:
        part.fmt = resolve_format(part.cfg, part.files, objective, part.field)
    mix.plan(cfg, found)
    return found


def prepare(
    cfg: DataConfig,
    tokenizer_dir: Path,
    output_url: str,
    on_progress: Callable[[int], None] | None = None,
    data_fingerprint: str | None = None,
    objective: str = "sft",
    reward_columns: list[str] | None = None,
) -> PreparedDataset:
    """Prepare (or find already prepared) the dataset for ``cfg``.

    Args:
        on_progress: called with the number of records read so far, once per batch.
        data_fingerprint: ``fingerprint(cfg, tokenizer_dir, objective)`` when the caller has it (a run's
            ``RunInputs``): the data is then not read twice, and the set prepared is the one the run's lineage names.
        objective: ``training.objective``: ``dpo`` reads preference pairs into one row per pair
            (``ladle.data.preference``); ``grpo`` reads prompt rows (``ladle.data.prompts``).
        reward_columns: grpo: the columns the rewards read, each checked present and named in the report.

    Raises:
        LadleError: a source is missing or unreadable, too many rows are bad, or nothing is usable.
    """
    fp = data_fingerprint or fingerprint(cfg, tokenizer_dir, objective)
    url = storage.join(output_url, "datasets", fp)
    if storage.is_complete(url):
        return PreparedDataset.model_validate(storage.read_json(storage.join(url, "manifest.json")))
    storage.remove(url)  # a partial folder from an interrupted attempt
    tokenizer = load_tokenizer(tokenizer_dir)
    if objective == "grpo":
        return finish_prompts(cfg, tokenizer, url, fp, reward_columns)
    found = resolve_parts(cfg, objective)
    fmt = "+".join(dict.fromkeys(part.fmt for part in found))
    held = eval_part(cfg, objective, None if cfg.sources else found[0].fmt)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    collector = Collector(cfg, url, pad, pairs=objective in PAIR_FORMAT)
    consume(collector, tokenizer, itertools.chain(mix.stream(cfg, found), eval_items(held)), on_progress)
    collector.finish()
    files = [f for part in found for f in part.files]
    report = build_report(collector, fmt, files + (held.files if held else []))
    report.mix = mix.report(cfg, found)
    storage.write_json(storage.join(url, "report.json"), report.model_dump())
    rejects = write_rejects(collector, url)
    check_usable(cfg, report, rejects)
    storage.write_bytes(
        storage.join(url, "length_histogram.png"), histogram_png(report.length_histogram, f"{fp} ({fmt})")
    )
    samples = write_eval_samples(collector, url)
    prepared = PreparedDataset(
        url=url,
        fingerprint=fp,
        seq_len=collector.train.seq_len,
        train_rows=report.train_rows,
        eval_rows=report.eval_rows,
        shards={"train": collector.train.shards, "eval": collector.eval.shards},
        report=report,
        eval_samples=samples,
    )
    storage.write_json(storage.join(url, "manifest.json"), prepared.model_dump())
    storage.mark_complete(url)
    return prepared


def finish_prompts(cfg: DataConfig, tokenizer, url: str, fp: str, reward_columns: list[str] | None) -> PreparedDataset:
    """Prepare prompt rows (``ladle.data.prompts``) and mark the set complete."""
    from ladle.data import prompts

    found = resolve_parts(cfg, "grpo")
    held = eval_part(cfg, "grpo", "prompt")
    items = itertools.chain(mix.stream(cfg, found), eval_items(held))
    report, splits, missing = prompts.collect(cfg, tokenizer, reward_columns, items)
    report.mix = mix.report(cfg, found)
    report.sources = [f for part in found for f in part.files] + (held.files if held else [])
    check_usable(cfg, report)
    if missing:
        raise LadleError(
            f"{cfg.describe()}: training.rl.rewards read the column(s) {sorted(missing)}, which some "
            "prompt rows lack. Add them to every row, or change the rewards."
        )
    shards = prompts.write(url, splits)
    storage.write_json(storage.join(url, "report.json"), report.model_dump())
    title = f"{fp} (prompt lengths)"
    storage.write_bytes(storage.join(url, "length_histogram.png"), histogram_png(report.length_histogram, title))
    prepared = PreparedDataset(
        url=url,
        fingerprint=fp,
        seq_len=cfg.seq_len,
        train_rows=report.train_rows,
        eval_rows=report.eval_rows,
        shards=shards,
        report=report,
        eval_samples=None,
    )
    storage.write_json(storage.join(url, "manifest.json"), prepared.model_dump())
    storage.mark_complete(url)
    return prepared


def write_rejects(collector: Collector, url: str) -> str | None:
    """Write every dropped row (source, line, reason, raw text) to ``rejects.jsonl``; its URL, or None."""
    if not collector.dropped:
        return None
    collector.rejects.seek(0)
    target = storage.join(url, "rejects.jsonl")
    storage.write_bytes(target, collector.rejects.read())
    return target


def write_eval_samples(collector: Collector, url: str) -> str | None:
    if not collector.eval_samples:
        return None
    body = "".join(json.dumps(sample, ensure_ascii=False) + "\n" for sample in collector.eval_samples)
    storage.write_bytes(storage.join(url, "eval_samples.jsonl"), body.encode())
    return "eval_samples.jsonl"


def load_tokenizer(tokenizer_dir: Path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    if not tokenizer.chat_template:
        raise LadleError(
            f"base = {str(tokenizer_dir)!r}: the tokenizer has no chat template. Use a chat/instruct tokenizer."
        )
    return tokenizer


def build_report(c: Collector, fmt: str, files: list[str]) -> DataReport:
    train, evals = c.train, c.eval
    return DataReport(
        rows_read=c.counts["rows_read"],
        rows_used=train.examples + evals.examples,
        dropped=c.dropped,
        invalid_rows=len(c.dropped) - c.counts["too_long"],
        too_long=c.counts["too_long"],
        duplicates_removed=c.counts["duplicates_removed"],
        train_examples=train.examples,
        eval_examples=evals.examples,
        tokens_total=c.counts["tokens_total"],
        tokens_trained=c.counts["tokens_trained"],
        truncations=c.counts["truncations"],
        prompt_truncations=c.counts["prompt_truncations"],
        completion_truncations=c.counts["completion_truncations"],
        train_rows=train.total_rows,
        eval_rows=evals.total_rows,
        packing_efficiency=round(train.real_tokens / max(1, train.total_rows * train.seq_len), 4),
        format=fmt,
        sources=files,
        length_histogram=c.hist.as_dict(),
    )


def check_usable(cfg: DataConfig, report: DataReport, rejects: str | None = None) -> None:
    """Fail when nothing is usable or more rows than ``max_bad_fraction`` are bad.

    The error carries every bad row (``details["dropped"]``, the name the report uses) and names the
    rejects file that holds each one with its raw text.
    """
    read, bad = report.rows_read, report.invalid_rows
    first = "; ".join(f"line {d['line']}: {d['reason']}" for d in report.dropped[:3])
    details = {"rows_read": read, "dropped": report.dropped, "rejects": rejects}
    every = f" Every bad row, with its text: {rejects}." if rejects else ""
    if read == 0:
        raise LadleError(f"{cfg.describe()}: the dataset is empty (0 rows). Point it at a file with rows.")
    if report.train_examples == 0:
        raise LadleError(
            f"{cfg.describe()}: no usable training rows (read {read}, dropped {len(report.dropped)}; {first}). "
            f"Fix the rows or data.format.{every}",
            details=details,
        )
    if bad / read > cfg.max_bad_fraction:
        raise LadleError(
            f"{cfg.describe()}: {bad} of {read} rows unusable ({bad / read:.1%} > "
            f"data.max_bad_fraction={cfg.max_bad_fraction}; {first}). Fix the rows or raise data.max_bad_fraction.{every}",
            details=details,
        )
