"""The compute targets' registry (``ladle.registry``'s shape, shared with the strategies and the serving backends):
the only place target names map to target classes. ``ladle.compute`` registers the shipped ones on import; the
config reads the names from here without importing the targets (which run what the config plans)."""

from __future__ import annotations

from ladle.registry import Registry

TARGETS: Registry = Registry("compute target", "compute.target")
"""``ComputeTarget`` subclasses (``ladle.compute.base``) by name; that module is not imported here, not even for
type checking: the targets run what the config plans, so it would close a circle."""
