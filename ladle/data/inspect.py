"""Looking at data before training on it: a quick census, and the trained span of sample rows."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict
from itertools import islice
from pathlib import Path

from ladle.config import DataConfig
from ladle.data import sources
from ladle.data.formats import RowError
from ladle.data.prepare import iter_samples, load_tokenizer, resolve_format, tokenize_samples
from ladle.data.tokenize import IGNORE
from ladle.errors import LadleError
from ladle.platform import storage


def inspect(cfg: DataConfig, n: int = 3, objective: str = "sft") -> dict:
    """Files, detected format, record counts, the commonest problems, and the first ``n`` parsed samples."""
    files = sources.expand(cfg.path)
    fmt = resolve_format(cfg, files, objective)
    state = {"rows_read": 0}
    reasons: Counter = Counter()
    samples = []
    for source, _, position, sample, _ in iter_samples(files, fmt, state):
        if isinstance(sample, RowError):
            reasons[str(sample)] += 1
        elif len(samples) < n:
            samples.append({"source": source, "line": position, "sample": asdict(sample)})
    sizes = [fs.size(path) for fs, path in map(storage.filesystem, files)]
    return {
        "files": [
            {"url": url, "kind": sources.kind_of(url), "bytes": size} for url, size in zip(files, sizes, strict=False)
        ],
        "format": fmt,
        "records": state["rows_read"],
        "invalid": sum(reasons.values()),
        "top_problems": [{"reason": r, "count": c} for r, c in reasons.most_common(5)],
        "samples": samples,
    }


def mask_rows(cfg: DataConfig, tokenizer_dir: Path, n: int = 3, objective: str = "sft") -> list[dict]:
    """The first ``n`` usable records tokenized exactly as for training (a preference pair: its row, the chosen
    side then the rejected side), each token with its trained flag."""
    if objective == "grpo":
        raise LadleError(
            "training.objective = grpo: prompt rows carry no trained tokens (grpo trains on the completions it "
            "samples); use `ladle data inspect` to see the parsed prompts and their columns."
        )
    tokenizer = load_tokenizer(tokenizer_dir)
    files = sources.expand(cfg.path)
    fmt = resolve_format(cfg, files, objective)
    usable = (item for item in iter_samples(files, fmt, {"rows_read": 0}) if not isinstance(item[3], RowError))
    out = []
    while len(out) < n:
        batch = list(islice(usable, n))
        if not batch:
            break
        results = tokenize_samples(tokenizer, [item[3] for item in batch], cfg, fmt == "preference")
        for (source, _, line, _, _), (example, truncated) in zip(batch, results, strict=False):
            if isinstance(example, RowError) or len(out) >= n:
                continue
            pieces = [
                (tokenizer.decode([tok]), label != IGNORE)
                for tok, label in zip(example.input_ids, example.labels, strict=False)
            ]
            out.append(
                {
                    "source": source,
                    "line": line,
                    "truncated": truncated,
                    "tokens": pieces,
                    "trained": sum(t for _, t in pieces),
                    "total": len(pieces),
                }
            )
    return out
