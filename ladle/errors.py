"""User-facing errors.

A ``LadleError`` is an expected failure caused by input (config, data, machine):
it is shown as one line naming the field, the value and the fix, never as a
traceback. Anything else that escapes is a bug and keeps its traceback.
"""

from __future__ import annotations

import json
import os


class LadleError(Exception):
    """An input or environment problem the user can fix.

    The message follows ``<field.path> = <value>: <what is wrong>. <how to fix>.``
    ``details`` holds what was computed before the failure (bad rows, plan
    candidates, ...); ``--json`` commands add it to their failure object.
    ``exit_code`` is the CLI's: 2 for bad input (the default), 1 for a run that failed.
    """

    def __init__(self, message: str, *, details: dict | None = None, exit_code: int = 2):
        super().__init__(message)
        self.details: dict = details or {}
        self.exit_code = exit_code

    def add_details(self, **computed) -> LadleError:
        """Attach what the caller computed before the failure (the error's own details win); returns self."""
        self.details = {**computed, **self.details}
        return self


class ConfigError(LadleError):
    """The configuration is invalid; ``problems`` lists every problem found."""

    def __init__(self, problems: list[str], *, details: dict | None = None):
        self.problems = problems
        message = "; ".join(problems) if len(problems) == 1 else "\n  ".join(["invalid config:", *problems])
        super().__init__(message, details={"problems": problems, **(details or {})})


def find_ladle_error(exc: BaseException | None) -> LadleError | None:
    """Return the first ``LadleError`` in ``exc``'s cause/context chain, if any (an object store that did not
    answer within its deadline counts: ``store_outage``)."""
    seen: set[int] = set()
    first = exc
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, LadleError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return store_outage(first)


UNREACHABLE = {"EndpointConnectionError", "ConnectTimeoutError"}
SILENT = {"ReadTimeoutError", "FSTimeoutError"}
"""botocore's and fsspec's errors (by name: this module imports neither) for a store that was not reached, and
for one that did not answer in time."""


def store_outage(exc: BaseException | None) -> LadleError | None:
    """The one error for an object store that was unreachable or silent past ``storage.*``'s deadlines."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        kind = type(exc).__name__
        if kind in UNREACHABLE | SILENT:
            try:
                settings = json.loads(os.environ.get("LADLE_STORAGE_DEADLINES", "{}"))  # storage.DEADLINES_ENV
            except ValueError:
                settings = {}
            tries = (settings.get("retries") or {}).get("max_attempts", "?")
            if kind in UNREACHABLE:
                field = f"storage.connect_timeout_s = {settings.get('connect_timeout', '?')}"
                what = "could not be reached"
                fix = "Check that it runs and that its endpoint (AWS_ENDPOINT_URL, the ArtifactStore block) is right"
            else:
                field = f"storage.read_timeout_s = {settings.get('read_timeout', '?')}"
                what = "accepted the connection but did not answer in time"
                fix = "Check the store's health, or raise storage.read_timeout_s / storage.retries"
            tried = f"{tries} {'try' if tries == 1 else 'tries'}"
            return LadleError(f"{field}: the object store {what} ({tried}; {exc}). {fix}.", exit_code=1)
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None
