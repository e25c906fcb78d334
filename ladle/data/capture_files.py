"""The layout of captured traffic (``serve.capture``): whole files under date (and model, version) partitions,
read back oldest first. The server's writer (``ladle.serve.capture``) and the curation (``ladle.data.traffic``)
share it.

    captures/date=YYYY-MM-DD/model=NAME/version=V/part-HOST-PID-MS-SEQ.jsonl
    feedback/date=YYYY-MM-DD/part-HOST-PID-MS-SEQ.jsonl
"""

from __future__ import annotations

import json
import re
from typing import Literal

FEEDBACK_EVENT = "ladle.feedback.received"
"""The Prefect event of each feedback a capturing server kept (once its file is written): a retraining deployment's
trigger may count them (``threshold`` within a window) to retrain when users have said enough
(deployments/prefect.yaml)."""

INTERNAL_HEADER = "x-ladle-internal"
"""Sent (value ``1``) by ladle's own requests to a server (the smoke request, the shadow replay): no user asked
them, so the capture keeps nothing of them."""


def safe(part: str) -> str:
    """A partition folder's value: the characters a path and an object key take."""
    return re.sub(r"[^A-Za-z0-9._\-]", "_", part) or "_"


PART = re.compile(r"^part-.+-(\d{13})-(\d{6})\.jsonl$")  # a writer's whole file: its time (ms) and sequence


def part_files(url: str, kind: str) -> list[str]:
    """The whole files of ``kind`` under ``url``, oldest first (by their date partition, then the time their
    writer put in the name); a writer's temporary file, which a crash may leave, is not one."""
    from ladle.platform import storage

    fs, root = storage.filesystem(storage.join(url, kind))
    if not fs.exists(root):
        return []
    found = []
    for path in fs.find(root):
        match = PART.match(path.rsplit("/", 1)[-1])
        if match:
            day = next((part for part in path.split("/") if part.startswith("date=")), "")
            found.append((day, match.group(1), match.group(2), path))
    return [path for *_, path in sorted(found)]


def file_lines(url: str, path: str) -> list[str]:
    from ladle.platform import storage

    fs, _ = storage.filesystem(url)
    with fs.open(path, "rb") as handle:
        return handle.read().decode("utf-8", errors="replace").splitlines()


def newest_files(url: str, kind: str):
    """Each whole file's lines, the newest file first."""
    for path in reversed(part_files(url, kind)):
        yield file_lines(url, path)


def read_records(url: str, kind: Literal["captures", "feedback"]) -> list[dict]:
    """Every record of ``kind`` under ``url``, oldest first: whole files only (``part_files``), and a line that
    does not parse is skipped rather than fatal."""
    out = []
    for path in part_files(url, kind):
        for line in file_lines(url, path):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out
