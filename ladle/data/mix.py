"""Several sources mixed into one training set (``data.sources``), by weight, row count or epochs, with a seed.

How much of each source is used (its *target*, in training rows before packing):

- ``rows: N`` — N rows; fewer than the source has are sampled, more repeat it whole first;
- ``epochs: e`` — ``round(e x its rows)`` rows the same way (3: three passes; 0.5: half of it);
- ``weight: w`` (the default, 1) — the weighted sources share what they give in proportion to their weights, as
  many rows as they allow without repeating one: the source that runs out first relative to its weight is used
  whole and the others are sampled. This is ``datasets.interleave_datasets``' ``first_exhausted`` rule, fixed at
  preparation instead of drawn row by row, so the achieved mix equals the asked one to the row. A small set that
  must weigh more than its size says so with ``epochs`` or ``rows``.

Each source's held-out rows (``data.eval_ratio``, the seeded split every format uses, keyed by the source too)
are set aside before anything is counted, sampled or repeated, so a repeated row never lands on both sides and
the held-out set is every source's own share, unweighted.

Memory stays bounded by one open file per source: the sources are counted in one pass (JSONL lines and Parquet
metadata without parsing a row), then streamed together. Which rows a sampled pass keeps is Knuth's selection
sampling (exactly the target, in file order, from a generator seeded by ``data.seed`` and the source), and the
sources are interleaved by stride scheduling — each next row comes from the source furthest behind its share —
so every window of the stream, and so every packed row, holds the mix. Repeats are passes: a source used 2.5 times
is read twice whole and once sampled. All of it is decided here, before training: any number of ranks reads the
same prepared rows.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import PurePosixPath

from ladle.config.training import DataConfig, DataSource
from ladle.data import sources
from ladle.errors import LadleError


@dataclass
class Part:
    """One source as resolved: its files, its view of the data options, and its counts."""

    index: int
    spec: DataSource
    field: str  # how errors name it: data.path, or data.sources[i].path
    cfg: DataConfig  # data.* with this source's path, format, system_prompt and train_on
    files: list[str]
    fmt: str = ""
    available: int | None = None  # training-side records (None: not counted, everything is used once)
    held_out: int = 0
    target: int | None = None
    counts: dict = field(
        default_factory=lambda: {
            "rows_read": 0,
            "held_out": 0,
            "dropped": 0,
            "not_sampled": 0,
            "train_examples": 0,
            "eval_examples": 0,
            "tokens_trained": 0,
        }
    )

    @property
    def label(self) -> str:
        return self.spec.label()


@dataclass
class Item:
    """A record on its way into the prepared set."""

    part: Part
    url: str
    position: int
    row: object  # dict, or the RowError it could not be read as
    to_eval: bool
    use: bool  # False: read (a bad row is reported) but not sampled into the mix
    copy: int  # the pass over the source it came in (0: the first; only that one reports bad rows)


def view(cfg: DataConfig, spec: DataSource) -> DataConfig:
    """``cfg`` as one source reads it: its path and its own format, system prompt and trained tokens."""
    return cfg.model_copy(
        update={
            "path": spec.path,
            "sources": None,
            "format": spec.format or cfg.format,
            "system_prompt": spec.system_prompt if spec.system_prompt is not None else cfg.system_prompt,
            "train_on": spec.train_on or cfg.train_on,
        }
    )


def parts(cfg: DataConfig) -> list[Part]:
    """The sources with their files (globs expanded).

    Raises:
        LadleError: a source names no file, naming its field.
    """
    out = []
    for index, spec in enumerate(cfg.source_list()):
        name = f"data.sources[{index}].path" if cfg.sources else "data.path"
        out.append(Part(index, spec, name, view(cfg, spec), sources.expand(spec.path, name)))
    return out


def is_mix(cfg: DataConfig) -> bool:
    """Whether the sources need counting: several, or one with a row count or epochs."""
    specs = cfg.source_list()
    return len(specs) > 1 or specs[0].rows is not None or specs[0].epochs is not None


def file_key(cfg: DataConfig, part: Part, file_index: int) -> int | str:
    """The split's key of a file: its index for ``data.path`` (the split it always had), the source and the index
    for ``data.sources``."""
    return f"{part.index}/{file_index}" if cfg.sources else file_index


def is_eval(seed: int, file_index: int | str, position: int, ratio: float) -> bool:
    """Seeded, order-independent split: the same record always lands on the same side."""
    if ratio <= 0:
        return False
    h = hashlib.blake2b(f"{seed}:{file_index}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") / 2**64 < ratio


def held_out(cfg: DataConfig, part: Part, file_index: int, position: int) -> bool:
    if cfg.eval_path:
        return False
    return is_eval(cfg.seed, file_key(cfg, part, file_index), position, cfg.eval_ratio)


def positions(url: str) -> Iterator[int]:
    """The 1-based positions of a file's records, as ``sources.iter_records`` numbers them, reading as little as
    it can: JSONL's non-blank lines without decoding them, Parquet's row count from its footer."""
    import fsspec

    kind = sources.kind_of(url)
    if kind == "jsonl":
        with fsspec.open(url, "rb", compression="infer") as fh:
            for line_no, raw in enumerate(fh, start=1):
                if raw.strip():
                    yield line_no
    elif kind == "parquet":
        import pyarrow.parquet as pq

        with fsspec.open(url, "rb") as fh:
            try:
                rows = pq.ParquetFile(fh).metadata.num_rows
            except Exception as exc:  # noqa: BLE001 - pyarrow raises ArrowInvalid and friends
                raise LadleError(
                    f"data file {url!r}: not a Parquet file ({exc}). Check the file or its suffix."
                ) from None
        yield from range(1, rows + 1)
    else:
        for position, _ in sources.iter_records(url):
            yield position


def count(cfg: DataConfig, part: Part) -> None:
    """Count ``part``'s training-side and held-out records."""
    train = evals = 0
    for file_index, url in enumerate(part.files):
        for position in positions(url):
            if held_out(cfg, part, file_index, position):
                evals += 1
            else:
                train += 1
    part.available, part.held_out = train, evals


def plan(cfg: DataConfig, found: list[Part]) -> None:
    """Count the sources and set each one's target (the module's rules). One source used once as it is is not
    counted: its target is every row.

    Raises:
        LadleError: a source without training rows, naming it.
    """
    if not is_mix(cfg):
        return
    for part in found:
        count(cfg, part)
        if part.available == 0:
            raise LadleError(
                f"{part.field} = {part.spec.path!r}: no training rows ({part.held_out} record(s), all held out by "
                "data.eval_ratio, or none). Point it at a file with rows, or remove the source."
            )
    weighted = [p for p in found if p.spec.rows is None and p.spec.epochs is None]
    for part in found:
        if part.spec.rows is not None:
            part.target = part.spec.rows
        elif part.spec.epochs is not None:
            part.target = max(1, round(part.spec.epochs * (part.available or 0)))
    if weighted:
        weights = [p.spec.weight or 1.0 for p in weighted]
        total = sum(weights)
        # The most rows the weighted sources give together without repeating one.
        whole = min((p.available or 0) * total / w for p, w in zip(weighted, weights, strict=True))
        for part, w in zip(weighted, weights, strict=True):
            part.target = min(part.available or 0, max(1, int(whole * w / total + 1e-9)))


def part_items(cfg: DataConfig, part: Part) -> Iterator[Item]:
    """``part``'s records in passes: the whole source as many times as its target holds it, then a sampled pass
    for the rest. Held-out records come once, in the first pass."""
    n, k = part.available, part.target
    if n is None or k is None:  # not counted: every record once
        full, rest = 1, 0
    else:
        full, rest = divmod(k, n)
    rng = random.Random(f"ladle-mix/{cfg.seed}/{part.index}")
    for copy in range(full + (1 if rest else 0)):
        sampled = copy == full
        seen = chosen = 0
        for file_index, url in enumerate(part.files):
            for position, row in sources.iter_records(url):
                if held_out(cfg, part, file_index, position):
                    if copy == 0:
                        yield Item(part, url, position, row, True, True, 0)
                    continue
                use = True
                if sampled:
                    use = rng.random() * (n - seen) < rest - chosen  # selection sampling: exactly `rest` of n
                    seen += 1
                    chosen += use
                if use or copy == 0:
                    yield Item(part, url, position, row, False, use, copy)


def stream(cfg: DataConfig, found: list[Part]) -> Iterator[Item]:
    """Every source's records interleaved by share: each next used row comes from the source whose used rows are
    furthest behind its target (ties: the first source), records that are not used in between."""
    if len(found) == 1:
        yield from part_items(cfg, found[0])
        return
    iters = {p.index: part_items(cfg, p) for p in found}
    used = dict.fromkeys(iters, 0)
    target = {p.index: max(1, p.target or 1) for p in found}
    heap = [(1 / target[i], i) for i in iters]
    heapq.heapify(heap)
    while heap:
        _, i = heapq.heappop(heap)
        for item in iters[i]:
            yield item
            if item.use and not item.to_eval:
                used[i] += 1
                heapq.heappush(heap, ((used[i] + 1) / target[i], i))
                break


def fingerprint_parts(cfg: DataConfig, digest) -> None:
    """What of ``data.sources`` goes into the prepared set's fingerprint: each one's options (not its path: the
    content is hashed) and its files' contents, in order."""
    for part in parts(cfg):
        digest.update(part.field.encode())
        digest.update(json.dumps(part.spec.model_dump(mode="json", exclude={"path"}), sort_keys=True).encode())
        for url in part.files:
            digest.update(f"{PurePosixPath(url).suffix}:{sources.signature(url)}".encode())


def report(cfg: DataConfig, found: list[Part]) -> list[dict] | None:
    """The mix as asked and as achieved, per source (None for one source used once)."""
    if not is_mix(cfg):
        return None
    trained = sum(p.counts["train_examples"] for p in found) or 1
    tokens = sum(p.counts["tokens_trained"] for p in found) or 1
    targets = sum(p.target or 0 for p in found) or 1
    out = []
    for p in found:
        asked = (
            {"rows": p.spec.rows}
            if p.spec.rows is not None
            else {"epochs": p.spec.epochs}
            if p.spec.epochs is not None
            else {"weight": p.spec.weight or 1.0}
        )
        out.append(
            {
                "name": p.label,
                "path": p.spec.path,
                "files": len(p.files),
                "format": p.fmt,
                **asked,
                "training_records": p.available,
                "target_rows": p.target,
                "passes": round((p.target or 0) / max(1, p.available or 1), 3),
                "asked_share": round((p.target or 0) / targets, 4),
                "achieved_share": round(p.counts["train_examples"] / trained, 4),
                "token_share": round(p.counts["tokens_trained"] / tokens, 4),
                **p.counts,
            }
        )
    return out
