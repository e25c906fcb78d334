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
    """Return the first ``LadleError`` in ``exc``'s cause/context chain, if any."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, LadleError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None
