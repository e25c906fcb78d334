"""Strategies: one class per strategy, each registered by its own module.

Every module of this package except ``base``, ``mesh``, ``registry`` and ``deepspeed_json`` (the ZeRO
strategies' JSON) is a strategy module: it defines its
class and calls ``register`` at import, and importing the package imports them all (in name order), so
adding a strategy is adding one file. Strategy modules import no torch at module level (planning stays
fast); what the worker needs from torch lives in ``runtime``. The config's ``parallelism.strategy``
type, the CLI's ``--deepspeed`` choices, the planner's candidates and the docs read the registry.
"""

from __future__ import annotations

import importlib
import pkgutil

from ladle.strategies.base import Candidate, Strategy, Target
from ladle.strategies.catalog import REGISTRY, default, get, register, resolve, sections, unregister

__all__ = [
    "REGISTRY",
    "Candidate",
    "Strategy",
    "Target",
    "default",
    "get",
    "register",
    "resolve",
    "sections",
    "unregister",
]

for _module in sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.ispkg):
    if _module not in ("base", "deepspeed_json", "mesh", "registry"):
        importlib.import_module(f"{__name__}.{_module}")
