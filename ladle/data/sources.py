"""Data sources: fsspec URLs (globs too) of JSONL, JSON, Parquet or CSV, read as a stream.

Every record comes with its 1-based position in its file — the line for JSONL
and CSV (the header is line 1), the element for a JSON array, the row for
Parquet — so a bad record can be reported where a person would look for it.
JSONL, CSV and Parquet are streamed with bounded memory; a JSON array is
parsed whole (use JSONL for large data).
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
from collections.abc import Callable, Iterator

import fsspec

from ladle.assets import resolve_builtin
from ladle.data.formats import RowError
from ladle.errors import LadleError, store_outage
from ladle.platform import storage

Record = tuple[int, "dict | RowError"]
COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")
GLOB_CHARS = "*?["


def kind_of(url: str) -> str:
    """The file type from its suffix, ignoring a compression suffix."""
    name = url.lower()
    for suffix in COMPRESSIONS:
        name = name.removesuffix(suffix)
    for kind in ("jsonl", "ndjson", "json", "parquet", "csv"):
        if name.endswith("." + kind):
            return "jsonl" if kind == "ndjson" else kind
    return "jsonl"


def expand(path: str, field: str = "data.path") -> list[str]:
    """The files a ``data.path`` names: one file, or every match of a glob (sorted).

    Raises:
        LadleError: nothing exists there, or the glob matches no file.
    """
    url = storage.normalise(resolve_builtin(path, field))
    fs, fs_path = storage.filesystem(url)
    if any(ch in fs_path for ch in GLOB_CHARS):
        protocol = url.split("://", 1)[0] + "://" if "://" in url else ""
        matches = sorted(p for p in fs.glob(fs_path) if fs.isfile(p))
        if not matches:
            raise LadleError(f"{field} = {path!r}: the pattern matches no file. Check the path and the pattern.")
        return [protocol + m if protocol and not m.startswith(protocol) else m for m in matches]
    try:
        # fs.info, not fs.isfile: isfile answers False for any error, so a store that is down read as "no such file"
        found = fs.info(fs_path).get("type") == "file"
    except FileNotFoundError:
        found = False
    except Exception as exc:  # noqa: BLE001 - any backend error means "cannot read it"
        outage = store_outage(exc)
        if outage is not None:
            raise outage from None
        raise LadleError(f"{field} = {path!r}: cannot be read ({exc.__class__.__name__}: {exc}).") from None
    if not found:
        raise LadleError(f"{field} = {path!r}: no such file. Check the path, or use ladle://demo-alpaca.")
    return [url]


def signature(url: str) -> str:
    """What identifies a file's content: its ETag when the store gives one, else a hash of its bytes."""
    fs, path = storage.filesystem(url)
    info = fs.info(path)
    etag = info.get("ETag") or info.get("etag")
    if etag and not storage.is_local(url):
        return f"etag:{etag}:{info.get('size')}"
    digest = hashlib.sha256()
    with fs.open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return f"sha256:{digest.hexdigest()}"


def _decode(raw: bytes) -> dict | RowError:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return _with_raw(RowError("invalid UTF-8"), raw)
    try:
        row = json.loads(text)
    except json.JSONDecodeError as exc:
        return _with_raw(RowError(f"malformed JSON ({exc.msg})"), raw)
    return (
        row
        if isinstance(row, dict)
        else _with_raw(RowError(f"a row must be a JSON object, got {type(row).__name__}"), raw)
    )


def _with_raw(err: RowError, raw: bytes) -> RowError:
    """Keep the undecodable line's text (invalid bytes replaced) for the rejects file."""
    err.raw = raw.decode("utf-8", errors="replace").rstrip("\r\n")
    return err


def read_jsonl(url: str) -> Iterator[Record]:
    with fsspec.open(url, "rb", compression="infer") as fh:
        for line_no, raw in enumerate(fh, start=1):
            if raw.strip():
                yield line_no, _decode(raw)


def read_json(url: str) -> Iterator[Record]:
    with fsspec.open(url, "rb", compression="infer") as fh:
        data = fh.read()
    try:
        rows = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LadleError(
            f"data file {url!r}: not a JSON document ({exc}). Use a JSON array of objects, or JSONL."
        ) from None
    if isinstance(rows, dict):
        rows = [rows]
    if not isinstance(rows, list):
        raise LadleError(f"data file {url!r}: expected a JSON array of objects, got {type(rows).__name__}.")
    for index, row in enumerate(rows, start=1):
        if isinstance(row, dict):
            yield index, row
        else:
            err = RowError(f"a row must be a JSON object, got {type(row).__name__}")
            err.raw = json.dumps(row, default=str)
            yield index, err


def read_csv(url: str) -> Iterator[Record]:
    with fsspec.open(url, "rb", compression="infer") as fh:
        text = io.TextIOWrapper(fh, encoding="utf-8", errors="strict", newline="")
        reader = csv.DictReader(text)
        try:
            for row in reader:
                line = reader.line_num
                if None in row:
                    yield line, RowError("more fields than the header")
                elif any(v is None for v in row.values()):
                    yield line, RowError("fewer fields than the header")
                else:
                    yield line, row
        except UnicodeDecodeError:
            yield reader.line_num + 1, RowError("invalid UTF-8 (the rest of the file is unreadable)")
        except csv.Error as exc:
            yield reader.line_num, RowError(f"malformed CSV ({exc})")


def read_parquet(url: str, batch_rows: int = 4096) -> Iterator[Record]:
    import pyarrow.parquet as pq

    with fsspec.open(url, "rb") as fh:
        try:
            parquet = pq.ParquetFile(fh)
        except Exception as exc:  # noqa: BLE001 - pyarrow raises ArrowInvalid and friends
            raise LadleError(f"data file {url!r}: not a Parquet file ({exc}). Check the file or its suffix.") from None
        index = 0
        for batch in parquet.iter_batches(batch_size=batch_rows):
            for row in batch.to_pylist():
                index += 1
                yield index, row


READERS: dict[str, Callable[[str], Iterator[Record]]] = {
    "jsonl": read_jsonl,
    "json": read_json,
    "csv": read_csv,
    "parquet": read_parquet,
}


def iter_records(url: str) -> Iterator[Record]:
    """Records of one file, each with its 1-based position."""
    return READERS[kind_of(url)](url)
