"""Prefect events ladle emits:

* ``ladle.model.promoted`` when a registered model's ``champion`` changes (a promotion, a canary that passed, or a
  rollback);
* ``ladle.model.canary`` when a version passed the offline gate and waits for its canary (``promote.canary``);
* ``ladle.model.canary_rolled_back`` when a canary was rolled back (the champion did not change);
* ``ladle.model.restarted`` when the front restarted the server behind it (``ladle.fleet.supervisor``);
* ``ladle.feedback.received`` for each user feedback a capturing server kept (``ladle.serve.capture``).

The serving deployment's trigger listens for the first two: it swaps the served version, or runs the canary.

Resource: ``ladle.model.<name>``, with labels ``ladle.model.name`` and ``ladle.model.version``.
"""

from __future__ import annotations

from ladle.data.capture_files import FEEDBACK_EVENT

PROMOTED = "ladle.model.promoted"
CANARY = "ladle.model.canary"
CANARY_ROLLED_BACK = "ladle.model.canary_rolled_back"
RESTARTED = "ladle.model.restarted"
FEEDBACK = FEEDBACK_EVENT

EVENTS = {
    PROMOTED: (
        "a registered model's `champion` changed: a promotion by the gate, a canary that passed, or a rollback",
        "`version`, `previous`, `reason`",
    ),
    CANARY: ("a version passed the gate and waits for its canary (`promote.canary`)", "`version`, `reason`"),
    CANARY_ROLLED_BACK: (
        "a canary was rolled back; the champion did not change",
        "`version`, `reason` (what the front measured)",
    ),
    RESTARTED: (
        "the front restarted the server behind it",
        "`reason` (why it was restarted), `restarts_in_window`",
    ),
    FEEDBACK: (
        "a capturing server kept a user's feedback on one of its answers (`POST /v1/feedback`); a retraining "
        "deployment's trigger may count them",
        "`response_id`, `value`, `corrected` (a correction came with it), `version`",
    ),
}
"""Every event ladle emits: what it means and its payload (the reference page is generated from this)."""


def resource_id(name: str) -> str:
    return f"ladle.model.{name}"


def emit(event: str, name: str, version: str, payload: dict) -> str | None:
    """Emit ``event`` for model ``name`` at ``version`` with ``payload`` (``version`` added); returns its id
    (None when no Prefect API took it)."""
    from prefect.events import emit_event

    sent = emit_event(
        event=event,
        resource={
            "prefect.resource.id": resource_id(name),
            "prefect.resource.name": name,
            "ladle.model.name": name,
            "ladle.model.version": str(version),
        },
        payload={"version": str(version), **payload},
    )
    return str(sent.id) if sent else None


def emit_promoted(name: str, version: str, reason: str, previous: str | None = None) -> str | None:
    """``ladle.model.promoted``; its id, or None."""
    return emit(PROMOTED, name, version, {"previous": previous, "reason": reason})


def emit_canary(event: str, name: str, version: str, reason: str) -> str | None:
    """``CANARY`` or ``CANARY_ROLLED_BACK``; its id, or None."""
    return emit(event, name, version, {"reason": reason})
