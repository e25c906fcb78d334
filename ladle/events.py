"""Prefect events ladle emits: ``ladle.model.promoted`` when a registered model's ``champion`` changes
(a promotion or a rollback). The serving deployment's trigger listens for it and swaps the served version.

Resource: ``ladle.model.<name>``, with labels ``ladle.model.name`` and ``ladle.model.version``.
"""

from __future__ import annotations

PROMOTED = "ladle.model.promoted"


def resource_id(name: str) -> str:
    return f"ladle.model.{name}"


def emit_promoted(name: str, version: str, reason: str, previous: str | None = None) -> str | None:
    """Emit the event; returns its id (None when no Prefect API took it)."""
    from prefect.events import emit_event

    event = emit_event(
        event=PROMOTED,
        resource={
            "prefect.resource.id": resource_id(name),
            "prefect.resource.name": name,
            "ladle.model.name": name,
            "ladle.model.version": str(version),
        },
        payload={"version": str(version), "previous": previous, "reason": reason},
    )
    return str(event.id) if event else None
