"""The strategies' registry: the only place strategy names map to strategy objects (``ladle.pluggable``'s shape,
shared with the serving backends and the compute targets)."""

from __future__ import annotations

from ladle.pluggable import Registry
from ladle.strategies.base import Strategy


def one_owner_per_section(registry: Registry[Strategy], strategy: Strategy) -> None:
    """An options section (``parallelism.deepspeed``) belongs to one options model."""
    section = strategy.options_section
    owner = next((s for s in registry.values() if s.options_section == section and section), None)
    if owner is not None and owner.options_model is not strategy.options_model:
        raise ValueError(f"strategy {strategy.name!r}: options section {section!r} belongs to {owner.name}")


REGISTRY: Registry[Strategy] = Registry("strategy", "parallelism.strategy", check=one_owner_per_section)
register = REGISTRY.register
unregister = REGISTRY.unregister
resolve = REGISTRY.resolve
get = REGISTRY.get


def default() -> Strategy:
    """The strategy used when nothing can be sized (the one marked ``fallback``: least communication)."""
    return next(s for s in REGISTRY.values() if s.fallback)


def sections() -> dict[str, Strategy]:
    """Each options section and the first strategy that owns it, in registry order."""
    out: dict[str, Strategy] = {}
    for strategy in REGISTRY.values():
        if strategy.options_section:
            out.setdefault(strategy.options_section, strategy)
    return out
