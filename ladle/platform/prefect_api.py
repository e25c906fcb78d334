"""The Prefect API a ``ladle run`` talks to: the user's server, or a temporary one ladle owns.

With ``PREFECT_API_URL`` set, ladle checks that something answers there and
starts nothing. Without it, Prefect would start its temporary server lazily,
when the flow makes its first API call, and give it
``PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS`` (20 s by default) to
answer. On a 2-core machine that server needs ~7 s idle (imports, database
migrations on first use) and more than 20 s when other work competes for the
cores, so a busy machine used to fail runs with a traceback.

ladle instead starts the same server (Prefect's own app factory, run by
uvicorn exactly as Prefect runs it) as soon as the config parses, before it
checks the inputs or imports torch or Prefect, so the server boots while the
rest of the process loads; it waits for it with a budget that fits slow machines
(``setdefault``: the user's setting wins); it stops it by terminate, wait,
kill; and when no server can be had, the user reads one line that says what to
set. Nothing here imports Prefect at module level: importing it is what the
early start overlaps.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ladle.errors import LadleError
from ladle.platform.processes import free_port, stop_process

BUDGET_VAR = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"
DEFAULT_BUDGET_S = "180"
PORT_IN_USE = 3  # uvicorn's exit code when the port is taken (Prefect retries on it too)
STOP_WAIT_S = 10.0


class ApiUnavailable(LadleError):
    """No Prefect API could be reached or started."""


def apply_defaults() -> None:
    """Environment defaults for an embedded run; set before Prefect is imported, never over the user's."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault(BUDGET_VAR, DEFAULT_BUDGET_S)


def startup_budget() -> int:
    """Seconds to wait for the temporary server (Prefect's own setting, an integer).

    Raises:
        ApiUnavailable: the variable is not a positive integer (Prefect itself would fail to import).
    """
    raw = os.environ.get(BUDGET_VAR, DEFAULT_BUDGET_S)
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value <= 0:
        raise ApiUnavailable(
            f"{BUDGET_VAR} = {raw!r}: must be a positive whole number of seconds. Set it to e.g. {DEFAULT_BUDGET_S}, or unset it."
        )
    return value


def _log_tail(path: Path, lines: int = 3) -> str:
    text = path.read_text(errors="replace").strip() if path.exists() else ""
    return " | ".join(text.splitlines()[-lines:]) or "(no output)"


class EmbeddedApi:
    """A temporary Prefect API server started early and waited for late.

    ``start()`` returns at once; ``wait()`` blocks until ``/api/health``
    answers (or the budget runs out); ``stop()`` terminates it, waits, then kills.
    """

    def __init__(self, log_dir: Path):
        self.log_path = log_dir / f"prefect-server-{os.getpid()}.log"
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.started_at = 0.0
        self.startup_s: float | None = None  # start -> first healthy answer
        self.waited_s: float | None = None  # how much of that the run spent blocked in wait()

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    def start(self) -> EmbeddedApi:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.started_at = time.perf_counter()
        with self.log_path.open("wb") as log:
            # The command Prefect's SubprocessASGIServer runs (prefect 3.8): its app factory under uvicorn,
            # flagged ephemeral (no UI, only the services an ephemeral server runs); the app's modules imported
            # first with the collector paused (ladle.platform.startup: ~1 s sooner to answer on 2 cores).
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "ladle.platform.startup",
                    "prefect.server.api.server",
                    "--",
                    "-m",
                    "uvicorn",
                    "--factory",
                    "prefect.server.api.server:create_app",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(self.port),
                    "--log-level",
                    "error",
                    "--lifespan",
                    "on",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={
                    **os.environ,
                    "PREFECT_UI_ENABLED": "0",
                    "PREFECT__SERVER_EPHEMERAL": "1",
                    "PREFECT__SERVER_FINAL": "1",
                },
            )
        return self

    def wait(self, budget_s: float) -> str:
        """Block until the server answers; returns its API URL.

        Raises:
            ApiUnavailable: it exited, or did not answer within ``budget_s`` seconds of its start.
        """
        import httpx

        entered = time.perf_counter()
        deadline = self.started_at + budget_s
        while True:
            code = self.proc.poll()
            if code == PORT_IN_USE:  # lost the port between choosing and binding it: take another
                self.start()
                deadline = self.started_at + budget_s
                continue
            if code is not None:
                raise ApiUnavailable(
                    f"Prefect API: the temporary server exited with code {code} before answering "
                    f"({_log_tail(self.log_path)}; log: {self.log_path}). Run `prefect server start` and set "
                    "PREFECT_API_URL=http://127.0.0.1:4200/api."
                )
            try:
                if httpx.get(f"{self.api_url}/health", timeout=5).status_code == 200:
                    self.startup_s = round(time.perf_counter() - self.started_at, 2)
                    self.waited_s = round(time.perf_counter() - entered, 2)
                    return self.api_url
            except httpx.HTTPError:
                pass
            if time.perf_counter() > deadline:
                self.stop()
                raise ApiUnavailable(
                    f"{BUDGET_VAR} = {budget_s:g}: the temporary Prefect API server did not answer in time "
                    f"(log: {self.log_path}). Raise {BUDGET_VAR}, or run `prefect server start` and set "
                    "PREFECT_API_URL=http://127.0.0.1:4200/api."
                )
            time.sleep(0.2)

    def stop(self) -> None:
        """Terminate, wait, kill: the server never outlives the run. A clean run leaves no log behind."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        stop_process(proc, grace_s=STOP_WAIT_S)
        if self.startup_s is not None:
            self.log_path.unlink(missing_ok=True)


def check_reachable(url: str, wait_s: float = 5.0) -> None:
    """Any HTTP answer from ``<url>/health`` will do (Prefect Cloud answers 401 without a key).

    Raises:
        ApiUnavailable: nothing answers there within ``wait_s`` seconds.
    """
    import httpx

    deadline = time.monotonic() + wait_s
    while True:
        try:
            httpx.get(f"{url.rstrip('/')}/health", timeout=5)
            return
        except httpx.HTTPError as exc:
            if time.monotonic() > deadline:
                raise ApiUnavailable(
                    f"PREFECT_API_URL = {url!r}: no Prefect API answers there ({exc.__class__.__name__}). Start the "
                    "server (`prefect server start`), fix the URL, or unset PREFECT_API_URL to let ladle run a "
                    "temporary one."
                ) from None
            time.sleep(0.5)


def drain_workers() -> None:
    """Send the logs and events Prefect still holds before its server goes away (as its test harness does)."""
    import inspect

    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.utilities.asyncutils import run_coro_as_sync

    async def drain() -> None:
        for result in (APILogWorker.drain_all(timeout=10), EventsWorker.drain_all(timeout=10)):
            if inspect.isawaitable(result):
                await result

    run_coro_as_sync(drain())


class PrefectApi:
    """What a ``ladle run`` uses: the configured server, or an embedded one; ``start()`` early, ``session()`` late."""

    def __init__(self, log_dir: Path):
        """Raises: ApiUnavailable: the startup budget is not a positive integer."""
        apply_defaults()
        self.budget_s = startup_budget()
        self.configured = os.environ.get("PREFECT_API_URL") or None
        self.embedded = None if self.configured else EmbeddedApi(log_dir)

    def start(self) -> PrefectApi:
        if self.embedded is not None:
            self.embedded.start()
        return self

    def timings(self) -> dict:
        """Seconds the embedded server took to answer, and how many of them the run waited (null: none started)."""
        api = self.embedded
        return {
            "prefect_api_startup_s": api.startup_s if api else None,
            "prefect_api_waited_s": api.waited_s if api else None,
        }

    @contextmanager
    def session(self) -> Iterator[str]:
        """Wait for the API, point Prefect at it for the block, and stop an embedded server after.

        Raises:
            ApiUnavailable: the API cannot be reached or started.
        """
        try:
            if self.embedded is None:
                check_reachable(self.configured)
                yield self.configured
                return
            url = self.embedded.wait(self.budget_s)
            from prefect.settings import PREFECT_API_URL, temporary_settings

            with temporary_settings(updates={PREFECT_API_URL: url}):
                try:
                    yield url
                finally:
                    drain_workers()
        finally:
            self.stop()

    def stop(self) -> None:
        if self.embedded is not None:
            self.embedded.stop()
