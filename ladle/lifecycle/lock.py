"""One writer of a registered model's ``champion`` at a time, wherever the writers run.

Why a lock in the registry: the nightly and the on-demand deployments are different Prefect deployments (each
``concurrency_limit: 1`` is its own), ``ladle run`` may use a temporary Prefect API of its own, and the serving
flow, a canary's verdict and ``ladle model rollback`` may run on other machines. What they all share is the
MLflow registry, so that is where the lock lives: a registered model named ``<name>.ladle-lock``, whose creation
the registry's store makes atomic (a second create of the same name is refused). Its tags say who holds it,
what for, and a heartbeat: the holder renews it every ``RENEW_S`` from a thread of its own for as long as it
holds it, however long its registry calls take (a slow registry's retries included). A waiter judges a holder
dead on its own clock only, never by comparing clocks across machines: when the holder's heartbeat has not moved
for ``LOCK_TTL_S`` of the waiter's time (or the lock says it expired so long ago, ``2 x LOCK_TTL_S``, that no
clock skew explains it), the lock is taken over. It is held only for the read-compare-write of the alias and the
champion history, never while a model is evaluated. Taking over a dead holder's lock is a read and then a delete:
two waiters doing that to the same dead lock in the same instant is the one window it leaves.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator

from ladle.errors import LadleError
from ladle.lifecycle.mlflow_client import absent, client, registry

LOCK_SUFFIX = ".ladle-lock"
LOCK_TTL_S = 120.0
"""Seconds a lock's heartbeat may stand still, on a waiter's clock, before its holder is taken for dead."""
RENEW_S = LOCK_TTL_S / 8
"""Seconds between a holder's renewals: eight chances before a waiter's patience ends."""
WAIT_S = 180.0
"""Seconds a writer waits for the lock before it fails naming the holder."""


def lock_name(name: str) -> str:
    return name + LOCK_SUFFIX


@contextlib.contextmanager
def champion_lock(uri: str, name: str, doing: str, wait_s: float = WAIT_S) -> Iterator[None]:
    """Hold ``name``'s champion lock while the block runs.

    Raises:
        LadleError: another writer held it for all of ``wait_s`` (its holder and what it does are named), or the
            registry failed.
    """
    token = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    mlflow = client(uri)
    deadline = time.monotonic() + wait_s
    holder: dict = {}
    seen, since = None, time.monotonic()  # the holder's (owner, heartbeat), and since when on this clock
    while True:
        with registry(uri, f"taking {name}'s champion lock for {doing}"):
            holder = acquire(mlflow, name, token, doing)
        if not holder:
            break
        beat = (holder.get("ladle.lock.owner"), holder.get("ladle.lock.beat"), holder.get("ladle.lock.expires"))
        if beat != seen:
            seen, since = beat, time.monotonic()
        if stale(holder) or time.monotonic() - since > LOCK_TTL_S:
            take_over(mlflow, name, holder)
            continue
        if time.monotonic() > deadline:
            raise LadleError(
                f"{name}: another writer of its champion ({holder.get('ladle.lock.owner')}, "
                f"{holder.get('ladle.lock.doing')}) held the registry's lock for all of {wait_s:.0f} s, so "
                f"{doing} did not run. Run it again once that one finished.",
                exit_code=1,
            )
        time.sleep(0.2)
    done = threading.Event()
    beating = threading.Thread(target=renew, args=(mlflow, name, token, done), name="ladle-lock-renew", daemon=True)
    beating.start()
    try:
        yield
    finally:
        done.set()
        beating.join(timeout=RENEW_S)
        with contextlib.suppress(Exception):  # a lock someone took over is theirs now
            release(mlflow, name, token)


def renew(mlflow, name: str, token: str, done: threading.Event) -> None:
    """The holder's heartbeat: every ``RENEW_S`` until ``done``, a new beat and expiry on its own lock (never on
    one that another writer took over). A failed renewal is tried again at the next beat."""
    beat = 0
    while not done.wait(RENEW_S):
        beat += 1
        with contextlib.suppress(Exception):  # a slow or failing registry: the next beat tries again
            held = dict(mlflow.get_registered_model(lock_name(name)).tags or {})
            if held.get("ladle.lock.owner") != token:
                return
            mlflow.set_registered_model_tag(lock_name(name), "ladle.lock.beat", str(beat))
            mlflow.set_registered_model_tag(lock_name(name), "ladle.lock.expires", str(time.time() + LOCK_TTL_S))


def stale(holder: dict) -> bool:
    """A lock whose own expiry passed ``LOCK_TTL_S`` ago (twice its life): dead whatever the clocks' skew."""
    return float(holder.get("ladle.lock.expires", "0")) + LOCK_TTL_S < time.time()


def take_over(mlflow, name: str, holder: dict) -> None:
    """Remove a dead holder's lock if it is still that holder's (another waiter may have removed it first)."""
    with contextlib.suppress(Exception):
        now = dict(mlflow.get_registered_model(lock_name(name)).tags or {})
        if now.get("ladle.lock.owner") == holder.get("ladle.lock.owner") and now.get("ladle.lock.beat") == holder.get(
            "ladle.lock.beat"
        ):
            mlflow.delete_registered_model(lock_name(name))


def acquire(mlflow, name: str, token: str, doing: str) -> dict:
    """Take the lock; empty when taken, else the holder's tags (whether that holder is dead is the waiter's to
    judge: ``champion_lock``)."""
    tags = {
        "ladle.lock.owner": token,
        "ladle.lock.doing": doing[:200],
        "ladle.lock.expires": str(time.time() + LOCK_TTL_S),
    }
    try:
        mlflow.create_registered_model(lock_name(name), tags=tags, description=f"ladle: {name}'s champion lock")
        return {}
    except Exception as exc:  # noqa: BLE001 - MLflow's "already exists" is an MlflowException
        if absent(exc):
            # MLflow's SQL store answers a refused create by reading the model that exists (prompt or model?):
            # released between its insert and that read, the create says "not found". It was held; it is free now.
            return {"ladle.lock.owner": "(just released)"}
        if getattr(exc, "error_code", None) != "RESOURCE_ALREADY_EXISTS":
            raise
    try:
        held = dict(mlflow.get_registered_model(lock_name(name)).tags or {})
    except Exception as exc:  # noqa: BLE001 - released between the two calls
        if absent(exc):
            return {"ladle.lock.owner": "(just released)"}
        raise
    return held


def release(mlflow, name: str, token: str) -> None:
    held = dict(mlflow.get_registered_model(lock_name(name)).tags or {})
    if held.get("ladle.lock.owner") == token:
        mlflow.delete_registered_model(lock_name(name))
