"""One shape for every set of named, pluggable things: strategies (``parallelism.strategy``), serving backends
(``serve.backend``) and compute targets (``compute.target``).

A ``Registry`` maps names (and aliases, any case) to what is registered, refuses a name twice, and is what the
config field's type, its JSON-schema choices, the CLI's choices, ``docs/config.md`` and the error naming the
choices are all read from: registering a new one is the only step that offers it everywhere.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, TypeVar

from ladle.errors import LadleError

T = TypeVar("T")


class Registry(Mapping[str, T], Generic[T]):
    """Registered things by name, in registration order. Each has ``name``, ``summary`` (one line for the
    docs) and optionally ``aliases``.

    Args:
        kind: what is registered, in words ("strategy", "serving backend").
        field: the config field that names one ("parallelism.strategy").
        check: more conditions on a new entry (raises ``ValueError``), e.g. an options section owned once.
        shipped: the module that registers the shipped entries, imported on first use where the registry's
            owner cannot import it (the compute targets import the config that reads their names).
    """

    def __init__(
        self,
        kind: str,
        field: str,
        check: Callable[[Registry[T], T], None] | None = None,
        shipped: str | None = None,
    ) -> None:
        self.kind, self.field, self._check, self._shipped = kind, field, check, shipped
        self._items: dict[str, T] = {}

    @property
    def _entries(self) -> dict[str, T]:
        if self._shipped is not None:
            module, self._shipped = self._shipped, None
            importlib.import_module(module)
        return self._items

    def __getitem__(self, name: str) -> T:
        return self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind}: {', '.join(self._entries)})"

    def register(self, item: T) -> T:
        """Add ``item`` under its name and aliases; returns it (usable as a class decorator).

        Raises:
            ValueError: the name or an alias is taken, or ``check`` refuses it.
        """
        taken = {n for other in self._entries.values() for n in names_of(other)}
        clash = sorted(taken & set(names_of(item)))
        if clash:
            raise ValueError(f"{self.kind} {item.name!r}: the name(s) {clash} are already registered")
        if self._check is not None:
            self._check(self, item)
        self._items[item.name] = item
        return item

    def unregister(self, name: str) -> None:
        """Remove a registered entry (tests that register their own)."""
        self._items.pop(name, None)

    def resolve(self, name: str) -> str | None:
        """The registered name that ``name`` (a name or an alias, any case) stands for; None if none does."""
        wanted = name.strip().lower()
        return next((item.name for item in self._entries.values() if wanted in names_of(item)), None)

    def get(self, name: str) -> T:  # type: ignore[override]
        """The entry called ``name`` (or an alias of it). Unlike a dict's ``get``, never a default: a name the
        config let through is registered, and any other is the user's to fix.

        Raises:
            LadleError: no such entry, naming the field, the value and the choices.
        """
        found = self.resolve(name) if isinstance(name, str) else None
        if found is None:
            raise LadleError(f"{self.field} = {name!r}: unknown {self.kind}. Use one of: {', '.join(self)}.")
        return self._entries[found]

    def first(self) -> T:
        """The first registered: the default where one runs anywhere."""
        return next(iter(self._entries.values()))

    def validator(self, *extra: str) -> Callable[[Any], Any]:
        """A pydantic ``mode="before"`` check for the config field: a registered name (or an alias, given as
        its name) or one of ``extra``, else pydantic's message for a ``Literal`` of the choices."""

        def check(value: Any) -> Any:
            if isinstance(value, str) and value in extra:
                return value
            found = self.resolve(value) if isinstance(value, str) else None
            if found is None:
                raise choice_error(value, [*extra, *self])
            return found

        return check

    def schema(self, preamble: str, first: tuple[str, ...] = ()) -> Callable[[dict], None]:
        """A ``json_schema_extra`` listing the names (and aliases) when a schema is generated, so an entry
        registered after import is documented and offered like the shipped ones."""

        def extra(schema: dict) -> None:
            items = [f"{name}{alias_note(obj)}: {obj.summary}" for name, obj in self.items()]
            schema["enum"] = [*first, *self]
            schema["description"] = preamble + "; ".join(items) + "."

        return extra


def names_of(item: Any) -> tuple[str, ...]:
    return (item.name, *getattr(item, "aliases", ()))


def alias_note(obj: Any) -> str:
    aliases = getattr(obj, "aliases", ())
    return f" (alias {', '.join(aliases)})" if aliases else ""


def choice_error(value: Any, choices: list[str]) -> ValueError:
    """The message pydantic gives a ``Literal`` field, for a field whose choices come from a registry."""
    quoted = [repr(c) for c in choices]
    return ValueError(f"Input should be {', '.join(quoted[:-1])} or {quoted[-1]}")
