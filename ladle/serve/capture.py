"""Traffic capture and feedback (``serve.capture``): what the served model heard and answered, and what its users
said about the answers, kept as files for the next model to learn from.

Opt-in and bounded. Each chat or text completion the server answers (a ``sample`` share of them) becomes one JSON
record: the request's messages or prompt, its sampling settings, the model name and version (the adapter's, when
one answered), the prompt and completion tokens, the latency and the response id the client got back (the OpenAI
``id``). Before anything is written, a redaction step replaces API keys, bearer tokens, passwords and e-mail
addresses (and the operator's own patterns) with ``[redacted:KIND]``. A record larger than ``max_record_bytes``
after redaction is not kept (counted). ``POST /v1/feedback`` attaches a score (thumbs up or down, or a number), a
corrected answer and a comment to a response id, shaped as MLflow's assessments (``source``, ``value``,
``rationale``).

Files, never a database: records are batched in memory and each batch is written as one whole file (a local
file through a rename, an object store's single put), so a crash loses at most the unwritten batch and never leaves
a torn file for a reader. Layout under ``url``::

    captures/date=YYYY-MM-DD/model=NAME/version=V/part-HOST-PID-SEQ.jsonl
    feedback/date=YYYY-MM-DD/part-HOST-PID-SEQ.jsonl

Capturing never slows or fails serving: the request path only puts the record on a bounded queue (a full queue
drops the record, counted) and a thread of its own redacts and writes. When the store fails (full, unwritable,
gone) or the total reaches ``max_total_mb``, capture stops: one warning, the metric
``ladle_capture_stopped{reason}``, and serving goes on; what was written stays.
"""

from __future__ import annotations

import json
import os
import queue
import random
import re
import socket
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Literal

from pydantic import Field, field_validator

from ladle.data.capture_files import (  # noqa: F401 - the layout's readers, and the header of ladle's own requests
    FEEDBACK_EVENT,
    INTERNAL_HEADER,
    newest_files,
    part_files,
    read_records,
    safe,
)
from ladle.section import Section

# What is never written: (kind, pattern). Keys first (an e-mail inside a URL with a key is still a key).
SECRETS: tuple[tuple[str, str], ...] = (
    ("api_key", r"\bsk-[A-Za-z0-9_\-]{16,}"),  # OpenAI-style keys (sk-..., sk-proj-...)
    ("api_key", r"\b(?:AKIA|ASIA)[A-Z0-9]{16}\b"),  # AWS access key ids
    ("api_key", r"\bgh[pousr]_[A-Za-z0-9]{30,}\b"),  # GitHub tokens
    ("api_key", r"\bhf_[A-Za-z0-9]{30,}\b"),  # Hugging Face tokens
    ("api_key", r"\bxox[abposr]-[A-Za-z0-9\-]{10,}"),  # Slack tokens
    ("bearer", r"(?i)\bbearer\s+[A-Za-z0-9._~+/=\-]{12,}"),
    # key = value, key: value, "key": "value" for the names that hold secrets
    (
        "secret",
        r"(?i)\b(?:api[_-]?key|secret|password|passwd|pwd|token|access[_-]?key)\b[\"']?\s*[:=]\s*[\"']?[^\s\"',;]+",
    ),
    ("email", r"[A-Za-z0-9._%+\-]+@[A-Za-z0-9.\-]+\.[A-Za-z]{2,}"),
)


class CaptureSettings(Section):
    """``serve.capture``: what the server keeps of its traffic and its users' feedback."""

    enabled: bool = Field(False, description="Record requests, answers and feedback. Off by default.")
    url: str | None = Field(
        None,
        description="Where the files go (a folder or an fsspec URL: s3://bucket/traffic). null: the run's "
        "output/traffic for a served pipeline, ./traffic for `ladle serve`.",
    )
    sample: float = Field(1.0, gt=0.0, le=1.0, description="Share of answered requests recorded (1: every one).")
    max_record_bytes: int = Field(
        256 * 1024,
        ge=1024,
        le=64 * 1024**2,
        description="Largest record kept, in bytes of JSON after redaction; a larger one is not kept (counted as "
        'ladle_capture_dropped{reason="too_large"}): a conversation cut short would teach the wrong thing.',
    )
    max_total_mb: float = Field(
        1024.0,
        gt=0.0,
        description='Capture stops (one warning, ladle_capture_stopped{reason="full"}) once this many MiB were '
        "written by this server; what was written stays.",
    )
    redact: list[str] = Field(
        default_factory=list,
        description="More regular expressions whose matches are replaced by [redacted:custom] before anything is "
        "written (API keys, bearer tokens, passwords and e-mail addresses always are).",
    )
    batch_records: int = Field(256, ge=1, le=100_000, description="Records per file, at most.")
    flush_s: float = Field(
        5.0, gt=0.0, le=3600.0, description="Seconds a record or a feedback waits at most before its file is written."
    )
    queue_records: int = Field(
        10_000, ge=1, le=1_000_000, description="Records waiting to be written, at most; past it one is dropped."
    )
    mlflow_experiment: str | None = Field(
        None,
        description="Also log each captured call as an MLflow trace (its request as inputs, its answer as outputs, "
        "tagged ladle.response_id) and each feedback as its assessment (the score as MLflow feedback, a correction "
        "as the expected response), in this experiment of the server's MLFLOW_TRACKING_URI. The files stay the "
        'source of truth: a trace MLflow refuses is counted (ladle_capture_dropped{reason="trace_failed"}) and '
        "skipped. null: off.",
    )
    feedback: Literal["last_wins", "refuse"] = Field(
        "last_wins",
        description="A second feedback for the same response id: last_wins keeps both and the later one counts "
        "(MLflow's assessment overrides); refuse answers 409 and keeps the first.",
    )
    feedback_window: int = Field(
        100_000,
        ge=1,
        le=10_000_000,
        description="Response ids this server remembers for feedback (the newest); an older id gets 404.",
    )
    max_correction_chars: int = Field(
        32_768, ge=1, le=10_000_000, description="Longest corrected answer in a feedback (HTTP 413 above)."
    )
    max_comment_chars: int = Field(4096, ge=1, le=1_000_000, description="Longest comment in a feedback (413 above).")

    @field_validator("redact")
    @classmethod
    def _patterns_compile(cls, value: list[str]) -> list[str]:
        for pattern in value:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"{pattern!r} is not a regular expression ({exc}); fix or remove it") from None
        return value


class Redactor:
    """Replaces secrets and e-mail addresses in every string of a record (``SECRETS`` and the operator's)."""

    def __init__(self, extra: list[str]):
        self.patterns = [(kind, re.compile(p)) for kind, p in SECRETS] + [("custom", re.compile(p)) for p in extra]

    def text(self, value: str) -> str:
        for kind, pattern in self.patterns:
            value = pattern.sub(f"[redacted:{kind}]", value)
        return value

    def record(self, value):
        """``value`` with every string redacted (dict keys included: a header name could carry one too)."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, dict):
            return {self.record(k) if isinstance(k, str) else k: self.record(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.record(v) for v in value]
        return value


@dataclass
class Batch:
    """Records waiting for one partition's next file."""

    records: list[str] = field(default_factory=list)
    since: float = field(default_factory=time.monotonic)


class FeedbackRefused(Exception):
    """A feedback that cannot be kept: ``status`` (404 unknown id, 409 a second one refused) and why."""

    def __init__(self, status: int, message: str, code: str):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


class Recorder:
    """The server's capture: ``record`` and ``feedback`` from the request path, a writer thread behind them."""

    def __init__(self, settings: CaptureSettings, url: str, model: str, version: str | None, metrics=None):
        self.settings, self.url, self.model, self.version = settings, url.rstrip("/"), model, version or "unknown"
        self.redactor = Redactor(settings.redact)
        self.metrics = metrics
        self.queue: queue.Queue = queue.Queue(maxsize=settings.queue_records)
        self.batches: dict[str, Batch] = {}  # partition folder -> records waiting
        self.known: OrderedDict[str, tuple[str, str]] = OrderedDict()  # response id -> (model, version), newest last
        self.judged: set[str] = set()  # ids with a feedback (``refuse``)
        self.lock = threading.Lock()
        self.written_bytes = 0
        self.stopped: str | None = None  # why capture stopped
        self.prefix = f"part-{socket.gethostname()}-{os.getpid()}"
        self.sequence = 0
        self.random = random.Random()
        self.closing = threading.Event()
        self.traces: Traces | None = None  # serve.capture.mlflow_experiment: opened by the writer on first use
        self.trace_warned = False
        self.thread = threading.Thread(target=self.run, name="ladle-capture", daemon=True)
        self.thread.start()

    # The request path ------------------------------------------------------------------------------------------

    def record(self, response_id: str, record: dict, model: str | None = None, version: str | None = None) -> bool:
        """Queue one answered request's record (a ``sample`` share of them), under the model and version that
        answered (an adapter's own name and label; the server's otherwise); never blocks, never raises. The id is
        remembered for feedback whether or not the record is sampled (feedback on an unsampled answer is kept too:
        it still says how the model did). Returns whether the record was queued."""
        model, version = model or self.model, version or self.version
        with self.lock:
            self.known[response_id] = (model, version)
            if len(self.known) > self.settings.feedback_window:
                old, _ = self.known.popitem(last=False)
                self.judged.discard(old)
        if self.stopped or self.random.random() >= self.settings.sample:
            return False
        return self.put(("captures", {"id": response_id, "model": model, "version": version, **record}))

    def feedback(self, body: dict) -> dict:
        """Keep one feedback (already checked for shape and sizes) for a response this server gave.

        Raises:
            FeedbackRefused: an id this server does not know (or no longer remembers), or a second feedback where
                ``serve.capture.feedback`` is ``refuse``.
        """
        response_id = body["response_id"]
        with self.lock:
            answered = self.known.get(response_id)
            if answered is None:
                raise FeedbackRefused(
                    404,
                    f"response_id {response_id!r}: no answer of this server has that id (or it is older than the "
                    f"{self.settings.feedback_window} newest, serve.capture.feedback_window).",
                    "unknown_response",
                )
            if response_id in self.judged and self.settings.feedback == "refuse":
                raise FeedbackRefused(
                    409,
                    f"response_id {response_id!r} already has a feedback (serve.capture.feedback = refuse).",
                    "feedback_exists",
                )
            if self.stopped:
                raise FeedbackRefused(
                    503, f"capture stopped ({self.stopped}): the feedback cannot be kept.", "capture_stopped"
                )
            kept = {"model": answered[0], "version": answered[1], "at": now_iso(), **body}
            if not self.put(("feedback", kept)):  # not marked judged: a retry may still keep it
                raise FeedbackRefused(503, "the capture queue is full: retry in a few seconds.", "capture_busy")
            self.judged.add(response_id)
        return kept

    def put(self, item) -> bool:
        try:
            self.queue.put_nowait(item)
            return True
        except queue.Full:
            self.count_dropped("queue_full")
            return False

    # The writer ------------------------------------------------------------------------------------------------

    def run(self) -> None:
        self.remember_written()
        while not (self.closing.is_set() and self.queue.empty()):
            try:
                item = self.queue.get(timeout=0.2)
            except queue.Empty:
                item = None
            try:
                if item is not None and not self.stopped:
                    self.take(*item)
                self.flush(force=self.closing.is_set())
            except Exception as exc:  # noqa: BLE001 - the writer never dies silently: capture stops, said once
                self.stop("error", f"{type(exc).__name__}: {exc}")
        if not self.stopped:
            self.flush(force=True)

    def remember_written(self) -> None:
        """The ids of the newest records already in the store, up to ``feedback_window``: a server restarted or
        swapped in over the same store takes feedback on answers its predecessor gave (answers that were not
        sampled were never written, and only their own server knew them)."""
        ids: list[tuple[str, tuple[str, str]]] = []
        try:
            for lines in newest_files(self.url, "captures"):
                for line in reversed(lines):
                    try:
                        record = json.loads(line)
                        ids.append((record["id"], (record["model"], record["version"])))
                    except (json.JSONDecodeError, KeyError, TypeError):
                        continue
                if len(ids) >= self.settings.feedback_window:
                    break
        except Exception as exc:  # noqa: BLE001 - an unreadable store: feedback on this server's own answers only
            print(f"ladle serve: capture: earlier answers not read ({type(exc).__name__}: {exc})", file=sys.stderr)
        with self.lock:
            for response_id, answered in reversed(ids[: self.settings.feedback_window]):
                self.known.setdefault(response_id, answered)
                self.known.move_to_end(response_id, last=False)  # older than anything this server answered

    def take(self, kind: str, record: dict) -> None:
        line = json.dumps(self.redactor.record(record), ensure_ascii=False, default=str)
        if len(line.encode()) > self.settings.max_record_bytes:
            self.count_dropped("too_large")
            return
        day = datetime.now(UTC).strftime("%Y-%m-%d")
        folder = f"{kind}/date={day}"
        if kind == "captures":
            folder += f"/model={safe(record['model'])}/version={safe(record['version'])}"
        self.batches.setdefault(folder, Batch()).records.append(line)
        if self.metrics is not None:
            self.metrics.captured.labels(kind).inc()

    def flush(self, force: bool = False) -> None:
        due = [
            folder
            for folder, batch in self.batches.items()
            if force
            or len(batch.records) >= self.settings.batch_records
            or time.monotonic() - batch.since >= self.settings.flush_s
        ]
        for folder in due:
            batch = self.batches.pop(folder)
            if batch.records and not self.stopped:
                self.write(folder, batch.records)

    def write(self, folder: str, records: list[str]) -> None:
        from ladle.platform import storage

        data = ("\n".join(records) + "\n").encode()
        if self.written_bytes + len(data) > self.settings.max_total_mb * 2**20:
            self.stop("full", f"{self.settings.max_total_mb:g} MiB written (serve.capture.max_total_mb)")
            return
        self.sequence += 1
        name = f"{self.prefix}-{int(time.time() * 1000)}-{self.sequence:06d}.jsonl"
        try:
            storage.write_bytes(storage.join(self.url, folder, name), data)
        except Exception as exc:  # noqa: BLE001 - a store's error of any kind stops capture, never serving
            self.stop("write_failed", f"{type(exc).__name__}: {exc}")
            return
        self.written_bytes += len(data)
        if folder.startswith("feedback/"):
            emit_feedback(records)
        if self.settings.mlflow_experiment:
            self.trace(folder.split("/", 1)[0], records)

    def trace(self, kind: str, records: list[str]) -> None:
        """The written records as MLflow traces (captures) or their assessments (feedback), best effort."""
        try:
            if self.traces is None:
                self.traces = Traces(self.settings.mlflow_experiment, self.settings.feedback_window)
            for line in records:
                (self.traces.log if kind == "captures" else self.traces.judge)(json.loads(line))
            if kind == "captures":  # exported now: a feedback that follows finds its trace
                self.traces.mlflow.flush_trace_async_logging()
        except Exception as exc:  # noqa: BLE001 - MLflow's errors of any kind: the files already hold the record
            self.count_dropped("trace_failed")
            if not self.trace_warned:
                self.trace_warned = True
                print(f"ladle serve: capture: MLflow trace not logged ({type(exc).__name__}: {exc})", file=sys.stderr)

    def stop(self, reason: str, why: str) -> None:
        if self.stopped:
            return
        self.stopped = reason
        print(f"ladle serve: capture stopped, serving goes on: {why}", file=sys.stderr, flush=True)
        if self.metrics is not None:
            self.metrics.capture_stopped.labels(reason).set(1)

    def count_dropped(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.capture_dropped.labels(reason).inc()

    def close(self, timeout: float = 30.0) -> None:
        """Write what waits and stop the writer (the server's shutdown); bounded by ``timeout``."""
        self.closing.set()
        self.thread.join(timeout)


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


def emit_feedback(records: list[str]) -> None:
    """``FEEDBACK_EVENT`` for each written feedback, from the writer thread (never the request path); best effort,
    and only where a Prefect API is configured (``PREFECT_API_URL``): a server runs with or without one."""
    if not os.environ.get("PREFECT_API_URL"):
        return
    try:
        from prefect.events import emit_event

        for line in records:
            kept = json.loads(line)
            emit_event(
                event=FEEDBACK_EVENT,
                resource={
                    "prefect.resource.id": f"ladle.model.{kept['model']}",
                    "ladle.model.name": kept["model"],
                    "ladle.model.version": str(kept["version"]),
                },
                payload={
                    "response_id": kept["response_id"],
                    "value": kept["value"],
                    "corrected": bool(kept.get("correction")),
                    "version": str(kept["version"]),
                },
            )
    except Exception as exc:  # noqa: BLE001 - an event that cannot be sent must not stop the capture
        print(f"ladle serve: {FEEDBACK_EVENT} not emitted: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)


class Traces:
    """Captured calls as MLflow traces and feedback as their assessments (MLflow 3), for MLflow's own UI and
    evaluation tools; the tracking server is the process's ``MLFLOW_TRACKING_URI``."""

    def __init__(self, experiment: str, remembered: int):
        import mlflow

        self.mlflow = mlflow
        self.client = mlflow.MlflowClient()
        found = self.client.get_experiment_by_name(experiment)
        self.experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
        self.ids: OrderedDict[str, str] = OrderedDict()  # response id -> trace id, the newest
        self.remembered = remembered

    def log(self, record: dict) -> None:
        request, answer = record.get("request", {}), record.get("answer", {})
        tags = {"ladle.response_id": record["id"], "ladle.model": record["model"], "ladle.version": record["version"]}
        span = self.client.start_trace(
            name=f"ladle.{record.get('route', 'chat')}",
            span_type="LLM",
            inputs=request,
            attributes={"prompt_tokens": record.get("prompt_tokens"), "latency_s": record.get("latency_s")},
            tags=tags,
            experiment_id=self.experiment_id,
        )
        self.client.end_trace(
            span.trace_id,
            outputs=answer,
            attributes={"completion_tokens": record.get("completion_tokens"), "finish": record.get("finish_reason")},
        )
        self.ids[record["id"]] = span.trace_id
        if len(self.ids) > self.remembered:
            self.ids.popitem(last=False)

    def trace_of(self, response_id: str) -> str | None:
        if response_id in self.ids:
            return self.ids[response_id]
        found = self.client.search_traces(
            locations=[self.experiment_id], filter_string=f"tags.`ladle.response_id` = '{response_id}'", max_results=1
        )
        return found[0].info.trace_id if found else None

    def judge(self, feedback: dict) -> None:
        from mlflow.entities import AssessmentSource

        trace_id = self.trace_of(feedback["response_id"])
        if trace_id is None:  # an answer that was not sampled, or older than the traces kept
            return
        source = feedback.get("source") or {}
        who = AssessmentSource(source_type=source.get("source_type", "HUMAN"), source_id=source.get("source_id"))
        self.mlflow.log_feedback(
            trace_id=trace_id,
            name=feedback.get("name", "user_feedback"),
            value=feedback["value"],
            source=who,
            rationale=feedback.get("rationale"),
        )
        if feedback.get("correction"):
            self.mlflow.log_expectation(
                trace_id=trace_id, name="expected_response", value=feedback["correction"], source=who
            )
