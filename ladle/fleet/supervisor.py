"""The front's supervision of the server behind it.

Where it lives, and why: in the front (``ladle.fleet.front``). The front already owns the upstream's record and
is what clients and probes talk to, so it is the process that must notice a dead server, restart it, and answer
503 with the reason when it cannot; a second supervisor process would need both. The front itself is what a
platform supervises: ``infra/systemd/ladle-front@.service`` runs it as a long-lived service, and a dead front is
restarted by systemd or the next ``ladle model serve``; the new front adopts the server it recorded.

Every ``check_s`` seconds the supervisor looks at the upstream: a process that is gone, or one that was ready
and has failed ``/ready`` for ``unready_checks`` looks in a row, is (killed and) started again with the argv it
was first started with, on the same port, after a backoff that doubles from ``backoff_s`` to ``backoff_max_s``.
Each restart is logged, counted (``ladle_front_restarts_total``) and emitted as the Prefect event
``ladle.model.restarted``. A request that finds the server down meanwhile is held (up to ``hold_s``) until the
restarted one is ready, so only the requests in flight on the dead server fail. More than ``max_restarts`` within ``window_s`` marks the upstream failed: the front
then answers 503 with the reason until a swap brings another server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import time
from collections import deque
from pathlib import Path

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge

from ladle.lifecycle.events import RESTARTED
from ladle.platform.processes import exited
from ladle.serve import pool

log = logging.getLogger("ladle.front")


class Supervisor:
    def __init__(
        self,
        name: str,
        state: dict,
        save,
        check_s: float = 2.0,
        unready_checks: int = 5,
        backoff_s: float = 1.0,
        backoff_max_s: float = 30.0,
        max_restarts: int = 5,
        window_s: float = 600.0,
        hold_s: float = 60.0,
    ):
        self.name, self.state, self.save = name, state, save
        self.check_s, self.unready_checks = check_s, unready_checks
        self.backoff_s, self.backoff_max_s = backoff_s, backoff_max_s
        self.max_restarts, self.window_s, self.hold_s = max_restarts, window_s, hold_s
        self.failed: str | None = None
        self.restarts: deque[float] = deque()
        self.child: subprocess.Popen | None = None  # a server this front started (reaped here)
        self.retired: list[subprocess.Popen] = []
        self.unready, self.was_ready = 0, False
        self.ready_pid: int | None = None  # the last server process seen ready
        self.registry = CollectorRegistry()
        self.counter = Counter("ladle_front_restarts", "Restarts of the served model's server.", registry=self.registry)
        Gauge(
            "ladle_front_failed", "1 when the server kept dying and was given up.", registry=self.registry
        ).set_function(lambda: 1.0 if self.failed else 0.0)

    def watch(self, upstream: dict) -> None:
        """A swap brought a new server: its own history starts now (a server this front restarted is stopped by
        the swap, and reaped here when it ends)."""
        if self.child is not None:
            self.retired.append(self.child)
        self.failed, self.child, self.unready, self.was_ready = None, None, 0, False
        self.restarts.clear()

    async def run(self) -> None:
        async with httpx.AsyncClient(timeout=2.0) as client:
            while True:
                await asyncio.sleep(self.check_s)
                self.retired = [child for child in self.retired if child.poll() is None]
                upstream = self.state["upstream"]
                if upstream is None or self.failed or not upstream.get("argv"):
                    continue
                why = await self.trouble(client, upstream)
                if why:
                    await self.restart(upstream, why)

    async def trouble(self, client: httpx.AsyncClient, upstream: dict) -> str | None:
        """Why the upstream needs a restart, or None."""
        if not self.running(upstream["pid"]):
            code = self.child.returncode if self.child is not None and self.child.pid == upstream["pid"] else None
            return f"its process {upstream['pid']} is gone" + (f" (exit {code})" if code is not None else "")
        try:
            ready = (await client.get(upstream["url"] + "/ready")).status_code == 200
        except httpx.HTTPError:
            ready = False
        self.was_ready = self.was_ready or ready
        if ready:
            self.ready_pid = upstream["pid"]
        self.unready = 0 if ready else self.unready + 1
        if self.was_ready and self.unready >= self.unready_checks:  # not while it is still starting
            return f"its /ready failed {self.unready} looks in a row"
        return None

    async def recovered(self, refused: dict) -> bool:
        """After ``refused`` (the upstream a request could not connect to) went down: wait up to ``hold_s`` for
        the supervisor to have it running and ready again, so a request that arrives during a restart is held
        instead of failed. False: not supervised, given up, or not back in time."""
        if not refused.get("argv"):
            return False
        deadline = time.monotonic() + self.hold_s
        while time.monotonic() < deadline and not self.failed:
            current = self.state["upstream"]
            if current is not None and current["pid"] != refused["pid"] and self.ready_pid == current["pid"]:
                return True
            await asyncio.sleep(0.1)
        return False

    def running(self, pid: int) -> bool:
        if self.child is not None and self.child.pid == pid:
            return self.child.poll() is None  # reaps our own child, and keeps its exit code for the message
        return not exited(pid)

    async def restart(self, upstream: dict, why: str) -> None:
        now = time.monotonic()
        self.restarts.append(now)
        while self.restarts and now - self.restarts[0] > self.window_s:
            self.restarts.popleft()
        version = upstream["version"]
        if len(self.restarts) > self.max_restarts:
            self.failed = (
                f"{self.name} v{version}: its server was restarted {self.max_restarts} times in "
                f"{self.window_s:g} s and died again ({why}); given up. Its log: {upstream.get('log')}. "
                "Roll back (`ladle model rollback`) or fix and serve again (`ladle model serve`)."
            )
            log.error(self.failed)
            return
        delay = min(self.backoff_max_s, self.backoff_s * 2 ** (len(self.restarts) - 1))
        log.warning("%s v%s: %s; restarting it in %.1f s", self.name, version, why, delay)
        await asyncio.sleep(delay)
        if self.state["upstream"] is not upstream:
            # Compare-and-set: a swap or rollback during the backoff brought another server, and it wins. The one
            # this restart was for is the swapper's to drain and stop.
            log.warning("%s v%s: not restarted: the front serves another server now", self.name, version)
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(upstream["pid"], signal.SIGKILL)  # a hung one; its process group: MII's processes too
        log_path = upstream.get("log")
        self.child = pool.launch(upstream["argv"], Path(log_path) if log_path else None, append=True)
        restarted = {**upstream, "pid": self.child.pid}
        self.state["upstream"] = restarted
        canary = self.state.get("canary")
        if canary is not None and canary.champion.get("url") == upstream["url"]:
            canary.champion = restarted  # whoever finishes the canary stops the process that runs, not a dead pid
        self.unready, self.was_ready = 0, False
        self.save(restarted)
        self.counter.inc()
        await asyncio.to_thread(emit_restarted, self.name, str(version), why, len(self.restarts))


def emit_restarted(name: str, version: str, why: str, count: int) -> None:
    """The Prefect event ``ladle.model.restarted`` (best effort: the front runs with or without a Prefect API)."""
    if not os.environ.get("PREFECT_API_URL"):
        log.info("ladle.model.restarted not emitted: no Prefect API (PREFECT_API_URL) is configured")
        return
    try:
        from prefect.events import emit_event

        from ladle.lifecycle.events import resource_id

        emit_event(
            event=RESTARTED,
            resource={
                "prefect.resource.id": resource_id(name),
                "ladle.model.name": name,
                "ladle.model.version": version,
            },
            payload={"reason": why, "restarts_in_window": count},
        )
    except Exception as exc:  # noqa: BLE001 - an event that cannot be sent must not stop supervision
        log.warning("ladle.model.restarted not emitted: %s", exc)
