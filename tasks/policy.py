"""Retry policy shared by the pipeline's tasks."""

from __future__ import annotations

from ladle.errors import find_ladle_error


def retry_unless_user_error(task, task_run, state) -> bool:
    """Retry crashes and flaky failures, never an input error: the same input fails the same way."""
    try:
        exc = state.result(raise_on_failure=False)
    except Exception:  # noqa: BLE001 - an unreadable result is not an input error
        return True
    return find_ladle_error(exc if isinstance(exc, BaseException) else None) is None
