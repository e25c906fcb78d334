"""The general-ability probe (``eval.probe``): questions with accepted answers, and how an answer is marked.

Read by the evaluation stage (``ladle.lifecycle.evaluate``: before and after training, the promotion gate) and by
GRPO's worker, which asks the live policy the same questions during training (the probe's trend in the report).
"""

from __future__ import annotations

import hashlib
import json

from ladle.errors import LadleError
from ladle.platform import storage

PROBE_BUILTIN = "ladle://general-probe"


def probe_file(url: str) -> str:
    """The probe's local path or URL: ``ladle://general-probe`` is shipped with ladle."""
    if url == PROBE_BUILTIN:
        from ladle.assets import recipes_dir

        return str(recipes_dir() / "probes" / "general-v1.jsonl")
    if url.startswith("ladle://"):
        raise LadleError(f"eval.probe = {url!r}: the one built-in probe is {PROBE_BUILTIN}.")
    return storage.normalise(url)


def load_probe(url: str) -> list[dict]:
    """The probe's questions, each ``{"question": str, "answers": [str, ...]}``.

    Raises:
        LadleError: the file is missing, or a row is not a question with at least one accepted answer.
    """
    path = probe_file(url)
    try:
        text = storage.read_bytes(path).decode("utf-8")
    except FileNotFoundError:
        raise LadleError(
            f"eval.probe = {url!r}: no such file. Point it at a JSONL file, or use {PROBE_BUILTIN}."
        ) from None
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise LadleError(f"eval.probe = {url!r}: line {number} is not JSON ({exc.msg}).") from None
        answers = row.get("answers") if isinstance(row, dict) else None
        if (
            not isinstance(row, dict)
            or not isinstance(row.get("question"), str)
            or not row["question"].strip()
            or not isinstance(answers, list)
            or not answers
            or not all(isinstance(a, str) and a.strip() for a in answers)
        ):
            raise LadleError(
                f"eval.probe = {url!r}: line {number} must be "
                '{"question": "...", "answers": ["accepted", ...]} with a question and at least one answer.'
            )
        rows.append({"question": row["question"], "answers": answers})
    if not rows:
        raise LadleError(f"eval.probe = {url!r}: the file holds no question.")
    return rows


def probe_digest(url: str | None) -> str:
    return hashlib.sha256(json.dumps(load_probe(url)).encode()).hexdigest()[:16] if url else "-"


def answered(answer: str, accepted: list[str]) -> bool:
    """``answer`` contains one of ``accepted`` as a whole word (or phrase), case ignored; a number is whole
    when no digits follow its point ("3" is not in "3.09")."""
    import re

    return any(re.search(rf"(?<!\w){re.escape(a.strip())}(?!\w|[.,]\d)", answer, re.IGNORECASE) for a in accepted)
