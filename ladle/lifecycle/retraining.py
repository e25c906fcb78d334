"""What a scheduled run decided on the registered model (trained or skipped, and why), kept on the model for
``ladle model list``."""

from __future__ import annotations

import json
import time

from ladle.lifecycle.mlflow_client import absent, client, registry

RETRAINING_TAG = "ladle.retraining.last"


def record_retraining_check(uri: str, name: str, entry: dict) -> bool:
    """Keep a scheduled run's decision (``entry``: decision, reason, fingerprint, flow run) on the registered
    model, stamped with the time; False when there is no registered model yet to keep it on."""
    with registry(uri, f"recording the retraining check on {name}"):
        try:
            client(uri).set_registered_model_tag(
                name, RETRAINING_TAG, json.dumps({**entry, "at": int(time.time())})[:8000]
            )
        except Exception as exc:  # noqa: BLE001 - MLflow raises its own error for a missing model
            if absent(exc):
                return False
            raise
    return True


def retraining_check(uri: str, name: str) -> dict | None:
    """The last scheduled run's decision kept by ``record_retraining_check``, or None."""
    with registry(uri, f"reading {name}'s retraining check"):
        tags = client(uri).get_registered_model(name).tags or {}
    return json.loads(tags[RETRAINING_TAG]) if RETRAINING_TAG in tags else None
