"""Looking at data before training on it: a quick census, and the trained span of sample rows."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict
from itertools import islice
from pathlib import Path

from ladle.config import DataConfig
from ladle.data import mix, sources
from ladle.data.formats import RowError
from ladle.data.prepare import iter_samples, load_tokenizer, resolve_format, tokenize_samples, with_system
from ladle.data.tokenize import IGNORE
from ladle.errors import LadleError
from ladle.platform import storage


def inspect(cfg: DataConfig, n: int = 3, objective: str = "sft") -> dict:
    """Files, detected format, record counts, the commonest problems, and the first ``n`` parsed samples (of each
    source, for ``data.sources``)."""
    found = mix.parts(cfg)
    state = {"rows_read": 0}
    reasons: Counter = Counter()
    samples, formats, files = [], [], []
    for part in found:
        fmt = resolve_format(part.cfg, part.files, objective, part.field)
        formats.append(fmt)
        files += part.files
        taken = 0
        for source, _, position, sample, _ in iter_samples(part.files, fmt, state):
            if isinstance(sample, RowError):
                reasons[str(sample)] += 1
            elif taken < n:
                taken += 1
                entry = {"source": source, "line": position, "sample": asdict(sample)}
                samples.append({**entry, "name": part.label} if cfg.sources else entry)
    sizes = [fs.size(path) for fs, path in map(storage.filesystem, files)]
    return {
        "files": [
            {"url": url, "kind": sources.kind_of(url), "bytes": size} for url, size in zip(files, sizes, strict=False)
        ],
        "format": "+".join(dict.fromkeys(formats)),
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
    out = []
    for part in mix.parts(cfg):
        out += part_mask_rows(part, tokenizer, n, objective)
    return out


def part_mask_rows(part: mix.Part, tokenizer, n: int, objective: str) -> list[dict]:
    """``mask_rows`` of one source, with its own format, system prompt and trained tokens."""
    cfg = part.cfg
    fmt = resolve_format(cfg, part.files, objective, part.field)
    usable = (item for item in iter_samples(part.files, fmt, {"rows_read": 0}) if not isinstance(item[3], RowError))
    out: list[dict] = []
    while len(out) < n:
        batch = list(islice(usable, n))
        if not batch:
            break
        chats = [with_system(item[3], cfg.system_prompt) for item in batch]
        results = tokenize_samples(tokenizer, chats, cfg, fmt == "preference")
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
