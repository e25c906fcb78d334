"""The registry: the only place strategy names map to strategy objects."""

from __future__ import annotations

from ladle.strategies.base import Strategy

REGISTRY: dict[str, Strategy] = {}


def register(strategy: Strategy) -> Strategy:
    """Add ``strategy`` under its name and aliases.

    Raises:
        ValueError: the name or an alias is taken, or its options section is taken by an unrelated model.
    """
    taken = {n for s in REGISTRY.values() for n in (s.name, *s.aliases)}
    clash = sorted(taken & {strategy.name, *strategy.aliases})
    if clash:
        raise ValueError(f"strategy {strategy.name!r}: the name(s) {clash} are already registered")
    section = strategy.options_section
    owner = next((s for s in REGISTRY.values() if s.options_section == section and section), None)
    if owner is not None and owner.options_model is not strategy.options_model:
        raise ValueError(f"strategy {strategy.name!r}: options section {section!r} belongs to {owner.name}")
    REGISTRY[strategy.name] = strategy
    return strategy


def unregister(name: str) -> None:
    """Remove a registered strategy (tests that register their own)."""
    REGISTRY.pop(name, None)


def resolve(name: str) -> str | None:
    """The registered name that ``name`` (a name or an alias, any case) stands for; None if none does."""
    wanted = name.strip().lower()
    return next((s.name for s in REGISTRY.values() if wanted in (s.name, *s.aliases)), None)


def get(name: str) -> Strategy:
    """The registered strategy called ``name``.

    Raises:
        KeyError: no such strategy (the config validates names before this).
    """
    return REGISTRY[name]


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
