"""Secrets stay secret: credentials are redacted from everything ladle logs, tags or writes as an artifact.

Two kinds of secret reach ladle: credentials inside URLs (``https://user:password@mlflow.example``) and
values in the environment (S3 keys exported by an ``ArtifactStore`` block, the serving API key, MLflow's
password or token). ``redact`` removes both from any text; ``install_log_redaction`` applies it to every
record this process logs, tracebacks included.
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


_credentials: dict[str, tuple[str, str]] = {}
"""Credentials taken out of http(s) tracking URIs in this process, by the URI's origin (scheme://host:port): a
process that reads two configs keeps each server's own, and none goes into the process's environment."""


def origin(uri: str) -> str:
    parts = urlsplit(uri)
    return f"{parts.scheme}://{parts.hostname}" + (f":{parts.port}" if parts.port else "")


def strip_credentials(uri: str) -> str:
    """``uri`` without its ``user:password@`` (http/https only); the pair kept in this process for that server
    alone (``with_credentials``, ``credential_env``) and the password registered as a secret."""
    from urllib.parse import unquote

    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https") or not parts.password:
        return uri
    _credentials[origin(uri)] = (unquote(parts.username or ""), unquote(parts.password))
    register(unquote(parts.password))
    return urlunsplit(parts._replace(netloc=origin(uri).split("://", 1)[1]))


def kept_pair(uri: str | None) -> tuple[str, str] | None:
    """The (user, password) this process keeps for ``uri``'s server, if any."""
    return _credentials.get(origin(uri)) if uri and uri.startswith(("http://", "https://")) else None


def with_credentials(uri: str) -> str:
    """``uri`` with the credentials this process keeps for its server put back (for MLflow's client in this
    process, whose HTTP library sends them as basic auth to that server only); other URIs unchanged."""
    from urllib.parse import quote

    pair = kept_pair(uri)
    if pair is None:
        return uri
    parts = urlsplit(uri)
    netloc = f"{quote(pair[0], safe='')}:{quote(pair[1], safe='')}@{parts.netloc.rsplit('@', 1)[-1]}"
    return urlunsplit(parts._replace(netloc=netloc))


def credential_env(uri: str | None) -> dict[str, str]:
    """MLflow's variables for a child process that talks to ``uri``'s server alone (a training rank), from the
    credentials this process keeps for that server; empty when it keeps none (the environment's own, if any,
    are inherited)."""
    pair = kept_pair(uri)
    return {"MLFLOW_TRACKING_USERNAME": pair[0], "MLFLOW_TRACKING_PASSWORD": pair[1]} if pair else {}


def refuse_url_password(value: str | None, field: str, fix: str) -> str | None:
    """``value`` unchanged unless it is a URL carrying a password, which would travel with the config (flow
    parameters, spec files, artifacts, run records): then a ValueError naming ``field``, the URL masked, and
    ``fix``."""
    if not value or "://" not in value:
        return value
    try:
        has_password = bool(urlsplit(value).password)
    except ValueError:
        has_password = False
    if has_password:
        raise ValueError(
            f"{field}'s URL carries a password, which would travel with the config (flow parameters, spec "
            f"files, artifacts, logs). {fix}"
        )
    return value


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


def scrub(record: logging.LogRecord) -> logging.LogRecord:
    """Mask secrets in a record's rendered message (arguments included), its traceback and its stack. The
    traceback is rendered here, masked, and kept as ``exc_text``, which formatters write instead of rendering
    the exception again."""
    try:
        message = record.getMessage()
    except Exception:  # noqa: BLE001 - a malformed record is the handler's problem, not ours
        return record
    clean = redact(message)
    if clean != message:
        record.msg, record.args = clean, ()
    if record.exc_info and record.exc_info[0] is not None:
        # Formatters print a record's exc_text when it is set: the masked rendering is what they write. The
        # exception itself stays (filters that judge it, such as the one-line LadleError, still see it); a
        # handler that renders the exception object on its own is not covered.
        record.exc_text = redact(record.exc_text or logging.Formatter().formatException(record.exc_info))
    elif record.exc_text:
        record.exc_text = redact(record.exc_text)
    if record.stack_info:
        record.stack_info = redact(record.stack_info)
    return record


class RedactSecrets(logging.Filter):
    """``scrub`` on every record a handler is given."""

    def filter(self, record: logging.LogRecord) -> bool:
        scrub(record)
        return True


def install_log_redaction() -> None:
    """Mask secrets in every log record this process makes, whichever handler writes it, now or added later:
    a record factory scrubs each record as it is made, and (for records made elsewhere and handed over, as
    Prefect's API handler does) ``RedactSecrets`` sits on the root, Prefect and ladle loggers' handlers.
    Idempotent."""
    factory = logging.getLogRecordFactory()
    if not getattr(factory, "ladle_redacts", False):

        def redacting(*args, **kwargs) -> logging.LogRecord:
            return scrub(factory(*args, **kwargs))

        redacting.ladle_redacts = True  # type: ignore[attr-defined]
        logging.setLogRecordFactory(redacting)
    for name in ("", "prefect", "prefect.flow_runs", "prefect.task_runs", "ladle"):
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, RedactSecrets) for f in handler.filters):
                handler.addFilter(RedactSecrets())
