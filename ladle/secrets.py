"""Secrets stay secret: credentials are redacted from everything ladle logs, tags or writes as an artifact.

Two kinds of secret reach ladle: credentials inside URLs (``https://user:password@mlflow.example``) and
values in the environment (S3 keys exported by an ``ArtifactStore`` block, the serving API key, MLflow's
password or token). ``redact`` removes both from any text; ``install_log_redaction`` applies it to every
record Prefect and ladle log.
"""

from __future__ import annotations

import logging
import os
import re
from urllib.parse import urlsplit, urlunsplit

MASK = "***"
# Environment variables whose values are secrets wherever they are set.
SECRET_VARS = (
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "MLFLOW_TRACKING_PASSWORD",
    "MLFLOW_TRACKING_TOKEN",
    "HF_TOKEN",
    "PREFECT_API_KEY",
    "LADLE_API_KEY",
)
SECRET_NAME = re.compile(r"(SECRET|PASSWORD|TOKEN|API_KEY)", re.IGNORECASE)
MIN_SECRET_LEN = 6  # shorter values would mask ordinary words
_extra: set[str] = set()
URL_CREDENTIALS = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<user>[^:/@\s]+):(?P<password>[^@\s/]+)@")


def register(value: str | None) -> None:
    """Treat ``value`` as a secret from now on (e.g. the API key named by ``serve.api_key_env``)."""
    if value and len(value) >= MIN_SECRET_LEN:
        _extra.add(value)


def secret_values() -> list[str]:
    """Every secret value known now, longest first (a secret containing another is masked whole)."""
    values = set(_extra)
    # Keys first, then .get: other threads (MLflow's telemetry) set and delete variables while this runs, and
    # os.environ.items() raises KeyError for a key deleted between its listing and its lookup.
    for name in list(os.environ):
        value = os.environ.get(name)
        if (name in SECRET_VARS or SECRET_NAME.search(name)) and value and len(value) >= MIN_SECRET_LEN:
            values.add(value)
    return sorted(values, key=len, reverse=True)


def redact_url(url: str) -> str:
    """``scheme://user:***@host/...``: the password of a URL masked (other URLs unchanged)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return redact(url)
    if parts.password:
        netloc = f"{parts.username}:{MASK}@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
        return urlunsplit(parts._replace(netloc=netloc))
    return url


def redact(text: str) -> str:
    """``text`` with URL passwords and every known secret value masked."""
    text = URL_CREDENTIALS.sub(lambda m: f"{m['scheme']}{m['user']}:{MASK}@", text)
    for value in secret_values():
        text = text.replace(value, MASK)
    return text


class RedactSecrets(logging.Filter):
    """Mask secrets in a record's rendered message (arguments included) before any handler writes it."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a malformed record is the handler's problem, not ours
            return True
        clean = redact(message)
        if clean != message:
            record.msg, record.args = clean, ()
        return True


def install_log_redaction() -> None:
    """Attach ``RedactSecrets`` to every handler of the root, Prefect and ladle loggers (idempotent)."""
    for name in ("", "prefect", "prefect.flow_runs", "prefect.task_runs", "ladle"):
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, RedactSecrets) for f in handler.filters):
                handler.addFilter(RedactSecrets())
