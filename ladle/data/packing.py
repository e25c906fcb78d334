"""Sequence packing: examples into fixed ``seq_len`` rows, first-fit-decreasing.

Each packed row carries position ids that restart at 0 for every sequence;
transformers turns such position ids into a block-diagonal causal mask, so no
token attends across a sequence boundary (tested: a packed row's loss equals
the token-weighted loss of its sequences run one by one).
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ladle.platform import storage

if TYPE_CHECKING:
    import pyarrow as pa

IGNORE = -100


def arrow():
    """pyarrow, imported on first use: loading it starts its allocator's background thread, and the CPU launcher
    (``ladle.train.launch``) imports this module before it forks the ranks, which must happen with one thread."""
    import pyarrow as pa
    import pyarrow.compute  # noqa: F401 - registers pa.compute
    import pyarrow.parquet  # noqa: F401

    return pa


@dataclass
class PackedRows:
    input_ids: list[list[int]] = field(default_factory=list)
    labels: list[list[int]] = field(default_factory=list)
    position_ids: list[list[int]] = field(default_factory=list)
    real_tokens_per_row: list[int] = field(default_factory=list)
    label: list[int] = field(default_factory=list)  # kto's rows: each one's label (1 desirable, 0 not)

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def real_tokens(self) -> int:
        return sum(self.real_tokens_per_row)

    def to_table(self) -> pa.Table:
        pa = arrow()
        columns = {
            "input_ids": pa.array(self.input_ids, type=pa.list_(pa.int32())),
            "labels": pa.array(self.labels, type=pa.list_(pa.int32())),
            "position_ids": pa.array(self.position_ids, type=pa.list_(pa.int32())),
            "real_tokens": pa.array(self.real_tokens_per_row, type=pa.int32()),
        }
        if self.label:
            columns["label"] = pa.array(self.label, type=pa.int32())
        return pa.table(columns)

    def to_parquet_bytes(self) -> bytes:
        return table_bytes(self.to_table())


def table_bytes(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    arrow().parquet.write_table(table, sink)
    return sink.getvalue()


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Group item indices into bins of at most ``capacity`` (longest items first)."""
    bins: list[list[int]] = []
    free: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        size = lengths[index]
        slot = next((b for b, room in enumerate(free) if room >= size), None)
        if slot is None:
            bins.append([index])
            free.append(capacity - size)
        else:
            bins[slot].append(index)
            free[slot] -= size
    return bins


def pack_examples(examples, seq_len: int, pad_id: int, pack: bool = True) -> PackedRows:
    """Pack examples (each at most ``seq_len`` tokens) into padded rows of ``seq_len``."""
    groups = (
        first_fit_decreasing([len(e.input_ids) for e in examples], seq_len)
        if pack
        else [[i] for i in range(len(examples))]
    )
    rows = PackedRows()
    for group in groups:
        ids, labels, positions = [], [], []
        for index in group:
            example = examples[index]
            ids += example.input_ids
            labels += example.labels
            # a preference pair carries its own (two sides, each from 0); an example counts from 0
            positions += getattr(example, "positions", None) or list(range(len(example.input_ids)))
        real = len(ids)
        pad = seq_len - real
        rows.input_ids.append(ids + [pad_id] * pad)
        rows.labels.append(labels + [IGNORE] * pad)
        rows.position_ids.append(positions + list(range(pad)))
        rows.real_tokens_per_row.append(real)
        if len(group) == 1 and getattr(examples[group[0]], "label", None) is not None:
            rows.label.append(examples[group[0]].label)
    return rows


def read_rows(data: bytes) -> dict[str, list]:
    """Read a packed parquet shard back into column lists."""
    return arrow().parquet.read_table(io.BytesIO(data)).to_pydict()


class SplitWriter:
    """Packs a stream of examples window by window and writes Parquet shards.

    Memory stays bounded: at most ``window`` examples (as Python lists) and
    one shard of packed rows (as Arrow int32 columns) are held at a time.
    Packing is first-fit-decreasing within each window.
    """

    def __init__(self, url: str, name: str, seq_len: int, pad_id: int, pack: bool, window: int = 20000):
        self.url, self.name, self.seq_len, self.pad_id, self.pack, self.window = (
            url,
            name,
            seq_len,
            pad_id,
            pack,
            window,
        )
        self.shard_rows = max(256, (32 << 20) // (seq_len * 12))  # about 32 MiB of int32 per shard
        self.pending: list = []
        self.buffer: list[pa.Table] = []
        self.buffered = 0
        self.shards: list[str] = []
        self.total_rows = 0
        self.real_tokens = 0
        self.examples = 0

    def add(self, example) -> None:
        self.pending.append(example)
        self.examples += 1
        if len(self.pending) >= self.window:
            self._pack()

    def _pack(self) -> None:
        table = pack_examples(self.pending, self.seq_len, self.pad_id, self.pack).to_table()
        self.pending = []
        self.buffer.append(table)
        self.buffered += table.num_rows
        while self.buffered >= self.shard_rows:
            self._flush(self.shard_rows)

    def _flush(self, count: int) -> None:
        pa = arrow()
        table = pa.concat_tables(self.buffer) if len(self.buffer) > 1 else self.buffer[0]
        head, rest = table.slice(0, count), table.slice(count)
        self.buffer, self.buffered = ([rest] if rest.num_rows else []), rest.num_rows
        name = f"{self.name}-{len(self.shards):05d}.parquet"
        storage.write_bytes(storage.join(self.url, name), table_bytes(head))
        self.shards.append(name)
        self.total_rows += head.num_rows
        self.real_tokens += int(pa.compute.sum(head["real_tokens"]).as_py() or 0)

    def close(self) -> None:
        if self.pending:
            self._pack()
        if self.buffered or not self.shards:
            if not self.buffer:
                self.buffer = [PackedRows().to_table()]
            self._flush(self.buffered)
