"""The base of every config section, shared by ``ladle.config`` and the strategies' option sections."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A config section: unknown keys are rejected, assignments validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
