"""Serve a registered model's ``champion`` behind ladle's front, and swap versions without failing a request.

``reconcile`` makes what is served equal to what the registry says:

1. the front (``ladle.fleet.front``) for the model runs on ``serve.front_port`` (started when missing);
2. if the front already serves the champion's version from a live server, nothing happens;
3. otherwise the champion's model starts on a new port, must become ready and answer a smoke request
   (a version that does not never takes traffic: it is stopped and the old one keeps serving);
4. the front switches new requests to it and waits until the old server has none in flight;
5. the old server is drained (SIGTERM: in-flight requests finish) and stopped.

Servers and the front run in their own sessions with run records, so they outlive the process (a Prefect
flow run, ``ladle model serve``) that started them; ``ladle model stop`` ends them.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
from pydantic import BaseModel, Field

from ladle.assets import ladle_home
from ladle.config import CanaryConfig, ServeConfig
from ladle.errors import LadleError
from ladle.fleet import canary as canaries
from ladle.fleet import front as router
from ladle.fleet.deploy import (
    DEFAULT_SMOKE,
    DeployFailed,
    SwapFailed,
    smoke,
    start_server,
    wait_healthy,
)
from ladle.lifecycle import promote
from ladle.lifecycle.copies import full_model_dir_of, model_dir_of

__all__ = ["full_model_dir_of", "model_dir_of", "reconcile"]
from ladle.platform.processes import free_port, stop_pid, stop_process
from ladle.platform.secrets import redact_url
from ladle.serve import backends, records


class Serving(BaseModel):
    model: str
    version: str = Field(description="The version now serving behind the front.")
    previous_version: str | None = Field(None, description="The version it replaced (None: nothing served before).")
    action: str = Field(description="`started` (first version), `swapped`, or `unchanged`.")
    front_url: str = Field(description="The stable address clients use.")
    server_url: str
    server_pid: int = Field(description="The server's process on this machine; 0 when Kubernetes runs it.")
    drained: bool = Field(True, description="The old server had no request in flight when it was stopped.")
    seconds: float = Field(description="From the start of the reconcile to the new version taking traffic.")
    canary: dict | None = Field(
        None, description="The canary this reconcile ran or finished (promote.canary): its verdict, reason, counts."
    )

    def message(self) -> str:
        if self.action == "unchanged":
            text = f"{self.model} v{self.version} already serving at {self.front_url}"
        else:
            was = f" (was v{self.previous_version})" if self.previous_version else ""
            text = (
                f"{self.model} v{self.version} serving at {self.front_url}{was}, {self.action} in {self.seconds:.1f} s"
            )
        if self.canary:
            verdict = self.canary["status"].replace("_", " ")
            text += f"; canary of v{self.canary['version']} {verdict}: {self.canary['reason']}"
        return text


def admin_headers(record: dict) -> dict:
    return {router.ADMIN_HEADER: record["token"]}


def ensure_front(name: str, cfg: ServeConfig, timeout_s: float = 60.0) -> dict:
    """The live front of ``name`` (started on ``serve.front_port`` when there is none); its run record.

    Raises:
        LadleError: the port is taken by something else, or the front did not come up.
    """
    record = router.read_record(name)
    if record is not None:
        return record
    url = f"http://{cfg.host}:{cfg.front_port}"
    log_path = ladle_home() / "served" / f"{name}-front-{cfg.front_port}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "ladle.fleet.front", "--name", name, "--host", cfg.host]
    argv += ["--max-body-bytes", str(cfg.limits.max_body_bytes)]
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [*argv, "--port", str(cfg.front_port)], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-600:]
            raise LadleError(
                f"serve.front_port = {cfg.front_port}: ladle's front for {name!r} could not start there ({tail.strip()}). "
                "Free the port or set serve.front_port to another one."
            )
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200 and (record := router.read_record(name)):
                return record
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    stop_process(proc, grace_s=5, group=True)
    raise LadleError(f"serve.front_port = {cfg.front_port}: the front did not answer within {timeout_s:.0f} s.")


def current_upstream(record: dict) -> dict | None:
    answer = httpx.get(record["url"] + "/ladle/upstream", headers=admin_headers(record), timeout=5)
    answer.raise_for_status()
    return answer.json()["upstream"]


def start_version(name: str, version: promote.Version, cfg: ServeConfig) -> tuple[subprocess.Popen, str, Path]:
    """Start ``version`` on a free port; ready and answering (its process, URL and log), or stopped and
    ``SwapFailed``."""
    backends.get(cfg.backend).check_host()
    extra = ["--model-version", str(version.version)]  # its captured traffic is partitioned by it
    proc, url, log_path = start_server(model_dir_of(version), name, cfg, free_port(), extra=extra)
    try:
        wait_healthy(proc, url, cfg.health_timeout_s, log_path)
        answer = smoke(url, name, cfg, [{"role": "user", "content": cfg.smoke_prompt or DEFAULT_SMOKE}])
    except (DeployFailed, httpx.HTTPError, KeyError, ValueError) as exc:
        stop_process(proc, grace_s=10, group=True)
        raise SwapFailed(
            f"{name} v{version.version} did not start or answer, so it takes no traffic: {str(exc)[:1500]}"
        ) from None
    except BaseException:
        stop_process(proc, grace_s=10, group=True)
        raise
    if not isinstance(answer, str):
        stop_process(proc, grace_s=10, group=True)
        raise SwapFailed(f"{name} v{version.version} answered the smoke request with {answer!r}")
    return proc, url, log_path


def reconcile(uri: str, name: str, cfg: ServeConfig, canary: CanaryConfig | None = None) -> Serving:
    """Serve ``name``'s current champion behind its front (see the module docstring); with ``canary``, then run
    the canary of a version that passed the gate and waits for one (``ladle.fleet.canary``). A canary the front
    decided earlier is finished first, so the registry says what the front serves before anything is compared.

    Raises:
        LadleError: no champion, or the front cannot start.
        SwapFailed: the champion's or the challenger's version did not start or answer (what was served keeps
            serving).
    """
    if cfg.target == "kubernetes":
        from ladle.fleet.kubernetes import KubernetesServing

        if canary is not None:
            raise LadleError("promote.canary needs ladle's front, and serve.target = 'kubernetes' has none")
        return Serving(**KubernetesServing(name, cfg).reconcile(uri))
    served = serve_champion(uri, name, cfg)
    if canary is None:
        return served
    front = router.read_record(name)
    wanted = canaries.pending(uri, name, served.version)
    if wanted is None:
        return served
    state = canaries.run(
        uri,
        name,
        wanted,
        cfg,
        canary,
        front,
        admin_headers(front),
        start=lambda: start_version(name, wanted, cfg),
        model_dir=str(model_dir_of(wanted)),
    )
    upstream = current_upstream(front)
    return served.model_copy(
        update={
            "version": str(upstream["version"]),
            "server_url": upstream["url"],
            "server_pid": upstream["pid"],
            "canary": state,
        }
    )


def serve_champion(uri: str, name: str, cfg: ServeConfig) -> Serving:
    """The champion behind the front (started, swapped, or unchanged), after finishing a decided canary."""
    started = time.monotonic()
    finished = None
    running = router.read_record(name)  # a front already running: no new one before the champion is known
    if running is not None:
        decided = canaries.front_canary(running, admin_headers(running))
        if decided is not None and decided["status"] != "running":
            finished = canaries.finish(uri, name, cfg, running, admin_headers(running), decided)
    wanted = promote.champion(uri, name)
    if wanted is None:
        raise LadleError(
            f"model {name!r} has no `champion` at {redact_url(uri)}: nothing to serve. Run the pipeline "
            "until a version is promoted, or set one with `ladle model rollback NAME --to VERSION`."
        )
    front = ensure_front(name, cfg)
    old = current_upstream(front)
    if old and str(old["version"]) == wanted.version and records.alive(old):
        return Serving(
            model=name,
            version=wanted.version,
            previous_version=wanted.version,
            action="unchanged",
            front_url=front["url"],
            server_url=old["url"],
            server_pid=old["pid"],
            seconds=0.0,
            canary=finished,
        )
    proc, url, log_path = start_version(name, wanted, cfg)
    body = {
        "url": url,
        "version": wanted.version,
        "pid": proc.pid,
        "model_dir": str(model_dir_of(wanted)),
        "argv": list(proc.args),  # how the front restarts it should it die
        "log": str(log_path),
        "drain_timeout_s": cfg.drain_timeout_s,
        "expect_url": old["url"] if old else None,  # compare-and-set: lose to a swap made meanwhile
    }
    try:
        switched = httpx.put(
            front["url"] + "/ladle/upstream", json=body, headers=admin_headers(front), timeout=cfg.drain_timeout_s + 30
        )
        if switched.status_code == 409:
            raise LadleError(
                f"{name} v{wanted.version}: not swapped in: {switched.json()['error']['message']}. Its server was "
                "stopped; run `ladle model serve` again to serve the champion as it is now.",
                exit_code=1,
            )
        switched.raise_for_status()
    except BaseException:
        stop_process(proc, grace_s=10, group=True)  # the front never took it: nothing else owns it
        raise
    took = time.monotonic() - started
    # The server the front had at the switch, which may not be the one read before the start: the front's
    # supervisor may have restarted it meanwhile (a new pid on the same address), and that one is stopped too.
    replaced = switched.json().get("previous") or old
    for server in {s["pid"]: s for s in (old, replaced) if s and s.get("pid") != proc.pid}.values():
        if records.alive(server):
            stop_pid(server["pid"], cfg.drain_timeout_s + 10, group=True)
    return Serving(
        model=name,
        version=wanted.version,
        previous_version=str(old["version"]) if old else None,
        action="swapped" if old else "started",
        front_url=front["url"],
        server_url=url,
        server_pid=proc.pid,
        drained=switched.json()["drained"],
        seconds=round(took, 3),
        canary=finished,
    )


def end_canary_at_front(name: str, reason: str) -> str | None:
    """Roll back the canary running at ``name``'s front on this machine, if any, so it can promote nothing after
    an operator's rollback; the version it was, or None. Its follower (the serving flow) then finishes it: the
    registry records it and its server is stopped."""
    front = router.read_record(name)
    if front is None:
        return None
    headers = {router.ADMIN_HEADER: front["token"]}
    state = canaries.front_canary(front, headers)
    if state is None or state["status"] != "running":
        return None
    answer = httpx.request(
        "PATCH", front["url"] + "/ladle/canary", params={"reason": reason}, headers=headers, timeout=10
    )
    answer.raise_for_status()
    return state["version"]


def stop(name: str, grace_s: float = 40.0) -> dict:
    """Stop ``name``'s front and the server behind it; returns what was stopped.

    Raises:
        LadleError: nothing is serving ``name`` on this machine.
    """
    front = router.read_record(name)
    if front is None:
        raise LadleError(f"NAME = {name!r}: no front is serving it on this machine (see `ladle model status`).")
    upstream = current_upstream(front)
    stop_pid(front["pid"], grace_s, group=True)
    if records.alive(upstream):
        stop_pid(upstream["pid"], grace_s, group=True)
    router.record_path(name).unlink(missing_ok=True)
    return {"front": front["url"], "server_pid": upstream["pid"] if upstream else None}
