"""Redaction covers what a handler added after it was installed writes, and the text of tracebacks: a secret in an
exception's message, raised and logged with ``logger.exception``, never reaches the output."""

from __future__ import annotations

import io
import logging

from ladle.platform.secrets import MASK, install_log_redaction


def test_a_secret_in_a_traceback_through_a_handler_added_later_is_masked(monkeypatch):
    secret = "s3cr3t-value-123456"
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", secret)
    install_log_redaction()
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)  # added after the installation, on a logger of nobody's
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logger = logging.getLogger("third.party.client")
    logger.addHandler(handler)
    try:
        try:
            raise ConnectionError(f"https://ci:{secret}@mlflow.internal/api refused; token {secret}")
        except ConnectionError:
            logger.exception("upload to %s failed", f"https://ci:{secret}@mlflow.internal")
        logger.warning("stack", stack_info=True, extra={"note": "stack info is redacted too"})
    finally:
        logger.removeHandler(handler)
    written = stream.getvalue()
    assert secret not in written
    assert f"https://ci:{MASK}@mlflow.internal" in written and "Traceback (most recent call last)" in written
    assert f"ConnectionError: https://ci:{MASK}@mlflow.internal/api refused; token {MASK}" in written
