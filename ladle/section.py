"""The base of every config section, shared by ``ladle.config`` and the strategies' option sections, and the
helpers of a field whose choices come from a registry (strategies, serving backends)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A config section: unknown keys are rejected, assignments validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def registry_choices(registry: dict, preamble: str, first: tuple[str, ...] = ()):
    """A ``json_schema_extra`` that lists ``registry``'s names (and aliases) when a schema is generated,
    so a strategy or backend registered after import is documented and offered like the shipped ones."""

    def extra(schema: dict) -> None:
        items = [f"{name}{alias_note(obj)}: {obj.summary}" for name, obj in registry.items()]
        schema["enum"] = [*first, *registry]
        schema["description"] = preamble + "; ".join(items) + "."

    return extra


def alias_note(obj) -> str:
    aliases = getattr(obj, "aliases", ())
    return f" (alias {', '.join(aliases)})" if aliases else ""


def choice_error(value: Any, choices: list[str]) -> ValueError:
    """The message pydantic gives a ``Literal`` field, for a field whose choices come from a registry."""
    quoted = [repr(c) for c in choices]
    return ValueError(f"Input should be {', '.join(quoted[:-1])} or {quoted[-1]}")
