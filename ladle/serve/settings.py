"""What a model server was started with."""

from __future__ import annotations

from dataclasses import dataclass, field

from ladle.serve.capture import CaptureSettings
from ladle.serve.guard import Control
from ladle.serve.limits import ServeLimits


@dataclass(frozen=True)
class Settings:
    """What the server was started with (``serve.*`` of the config)."""

    model: str
    max_new_tokens: int = 32
    api_key: str | None = None
    limits: ServeLimits = field(default_factory=ServeLimits)
    control: Control = field(default_factory=Control)  # who may use the control routes (none by default)
    adapter_sources: tuple[str, ...] = ()  # where POST /v1/adapters may load from (none: it loads nothing)
    capture: CaptureSettings = field(default_factory=CaptureSettings)  # serve.capture (off by default)
    version: str | None = None  # the registered version served (captured records are partitioned by it)
