"""What a model server was started with."""

from __future__ import annotations

from dataclasses import dataclass, field

from ladle.serve.limits import ServeLimits


@dataclass(frozen=True)
class Settings:
    """What the server was started with (``serve.*`` of the config)."""

    model: str
    max_new_tokens: int = 32
    api_key: str | None = None
    limits: ServeLimits = field(default_factory=ServeLimits)
