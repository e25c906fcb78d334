"""The data report: what was read, used, dropped (by line, with the reason), and how well it packed."""

from __future__ import annotations

import io

from pydantic import BaseModel, Field

HIST_BINS = 16


class DataReport(BaseModel):
    rows_read: int = Field(description="Records read from the sources (blank lines are not records).")
    rows_used: int = Field(description="Records turned into training or eval examples.")
    dropped: list[dict] = Field(
        description='Records not used: {"line": N (1-based, in its file), "reason": ..., "source": ...}.'
    )
    invalid_rows: int = Field(description="Dropped because the record is unusable (counts toward max_bad_fraction).")
    too_long: int = Field(0, description="Dropped by data.truncation=drop (not counted as bad).")
    duplicates_removed: int = Field(0, description="Exact duplicates skipped (data.dedup).")
    train_examples: int
    eval_examples: int
    tokens_total: int = Field(description="Real (non-padding) tokens over train and eval.")
    tokens_trained: int = Field(description="Tokens that carry a loss.")
    truncations: int = Field(
        description="Examples cut to seq_len (data.truncation=right); pairs with either cut below."
    )
    prompt_truncations: int = Field(
        0, description="Preference pairs whose prompt kept its last data.max_prompt_tokens."
    )
    completion_truncations: int = Field(0, description="Preference pairs with a completion cut to fit data.seq_len.")
    train_rows: int = Field(description="Packed training rows of seq_len tokens (a preference pair: 2 x seq_len).")
    eval_rows: int = Field(description="Packed eval rows of seq_len tokens.")
    packing_efficiency: float = Field(description="Real tokens / (rows x seq_len) over the training rows.")
    format: str
    sources: list[str] = Field(default_factory=list)
    length_histogram: dict = Field(default_factory=dict, description="Example lengths: bin edges and counts.")
    mix: list[dict] | None = Field(
        None,
        description="data.sources: per source, what was asked (weight, rows or epochs), its training records, the "
        "rows it was to give (target_rows, passes over it), the asked and achieved share of the training examples "
        "(and of trained tokens), and its rows read, held out, dropped, not sampled and used. null: one source.",
    )
    reward_columns: list[str] | None = Field(
        None,
        description="Prompt rows (training.objective: grpo): the columns the rewards receive: those they read by "
        "name, or every column the rows have when a reward takes **kwargs. null for other objectives.",
    )


class LengthHistogram:
    """Counts of example lengths in ``HIST_BINS`` equal bins over 0..seq_len."""

    def __init__(self, seq_len: int):
        self.edges = [round(seq_len * i / HIST_BINS) for i in range(HIST_BINS + 1)]
        self.counts = [0] * HIST_BINS
        self.seq_len = seq_len

    def add(self, length: int) -> None:
        self.counts[min(HIST_BINS - 1, length * HIST_BINS // (self.seq_len + 1))] += 1

    def as_dict(self) -> dict:
        return {"edges": self.edges, "counts": self.counts}


def histogram_png(hist: dict, title: str) -> bytes:
    """The length histogram as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    edges, counts = hist["edges"], hist["counts"]
    fig, ax = plt.subplots(figsize=(6, 3.2), dpi=100)
    ax.bar(
        edges[:-1],
        counts,
        width=[b - a for a, b in zip(edges, edges[1:], strict=False)],
        align="edge",
        edgecolor="white",
    )
    ax.set_xlabel("example length (tokens)")
    ax.set_ylabel("examples")
    ax.set_title(title)
    fig.tight_layout()
    out = io.BytesIO()
    fig.savefig(out, format="png")
    plt.close(fig)
    return out.getvalue()
