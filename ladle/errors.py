"""User-facing errors.

A ``LadleError`` is an expected failure caused by input (config, data, machine):
it is shown as one line naming the field, the value and the fix, never as a
traceback. Anything else that escapes is a bug and keeps its traceback.
"""

from __future__ import annotations


class LadleError(Exception):
    """An input or environment problem the user can fix.

    The message follows ``<field.path> = <value>: <what is wrong>. <how to fix>.``
    ``details`` holds what was computed before the failure (bad rows, plan
    candidates, ...); ``--json`` commands add it to their failure object.
    """

    def __init__(self, message: str, *, details: dict | None = None):
        super().__init__(message)
        self.details: dict = details or {}


class ConfigError(LadleError):
    """The configuration is invalid; ``problems`` lists every problem found."""

    def __init__(self, problems: list[str], *, details: dict | None = None):
        self.problems = problems
        message = "; ".join(problems) if len(problems) == 1 else "\n  ".join(["invalid config:", *problems])
        super().__init__(message, details={"problems": problems, **(details or {})})


def find_ladle_error(exc: BaseException | None) -> LadleError | None:
    """Return the first ``LadleError`` in ``exc``'s cause/context chain, if any."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, LadleError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None
