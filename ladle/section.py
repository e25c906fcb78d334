"""The base of every config section, shared by ``ladle.config``, the strategies' option sections and the
serving limits (a field whose choices come from a registry: ``ladle.pluggable``)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A config section: unknown keys are rejected, assignments validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
