"""Serve a registered adapter (``promote.merge: false``) on a server of its base, beside the other adapters of
that base.

One base, one server, one front: the front is named after the base's signature (``base-<12 hex>``) and listens on
``serve.front_port``; behind it, ``python -m ladle.serve`` of the base holds every adapter bound to it, each
following its registered model's ``champion`` and ``challenger`` (``ladle.serve.adapter_sync``). The front
restarts that server should it die (its supervisor), and the restarted server reads its bindings file and the
registry again, so it serves the same versions.

``reconcile`` (what ``ladle model serve`` and the serving deployment run for an adapter) makes that true for one
adapter:

1. the adapter's champion records the base it was trained on; the config's base must be that base (the same
   signature), or nothing starts;
2. the base's front runs (started when missing), and a live server is behind it (started when missing, with this
   adapter bound);
3. the adapter is bound to the server (``POST /v1/adapters/bind``, which also reads the registry now), so a new
   champion or a rollback is served at once;
4. the server must then serve the champion's version under the adapter's name, and answer a request for it;
5. with ``promote.canary``, a version that passed the gate and waits for its canary (``challenger``) takes a share
   of this adapter's traffic at the base's front (``run_canary``): the other adapters, and requests that name a
   version (``NAME@v3``), are not touched. The front judges it as it judges a served model's canary; the verdict is
   then applied to this adapter's registered model alone, under its own lock, and the server follows the registry.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from ladle.config import CanaryConfig, LadleConfig
from ladle.errors import LadleError
from ladle.fleet import canary as canaries
from ladle.fleet import front as router
from ladle.fleet.deploy import DEFAULT_SMOKE, SwapFailed, smoke, start_server, wait_healthy
from ladle.lifecycle import promote
from ladle.platform.processes import free_port, stop_process
from ladle.serve import records


def serve_registered(uri: str, name: str, cfg, base_dir) -> tuple[dict, str]:
    """``ladle model serve`` of config ``cfg``: an adapter champion on its base's server
    (``ladle.fleet.adapters``; ``base_dir()`` gives the config's base as a local folder), any other behind a front
    of its own (``reconcile``). Returns what is served and a line saying so."""
    from ladle.fleet import champion

    wanted = promote.champion(uri, name)
    if wanted is not None and wanted.tags.get("ladle.kind") == "adapter":
        if cfg.serve.target == "kubernetes":
            served = on_kubernetes(uri, name, cfg, wanted, Path(base_dir()))
        else:
            served = reconcile(uri, name, cfg, wanted, Path(base_dir()))
        line = (
            f"{name} v{served['version']}: served on {served['base']} ({served['action']}) at {served['front_url']} "
            f"as model {name!r}; that server holds {len(served['adapters'])} adapter(s)"
        )
        if served["canary"]:
            verdict = served["canary"]["status"].replace("_", " ")
            line += f"; canary of v{served['canary']['version']} {verdict}: {served['canary']['reason']}"
        return served, line
    served = champion.reconcile(uri, name, cfg.serving(), cfg.promote.canary)
    return served.model_dump(), served.message()


def front_name(signature: str) -> str:
    return f"base-{signature[:12]}"


def checked_base(cfg: LadleConfig, name: str, champion: promote.Version, base_dir: Path) -> str:
    """The signature of the config's base (``base_dir``: it as a local folder), which must be the one adapter
    ``name``'s ``champion`` was trained on.

    Raises:
        LadleError: another base, naming both signatures.
    """
    from ladle.lifecycle.copies import base_signature

    trained_on = champion.tags.get("ladle.base_signature", "")
    signature = base_signature(base_dir)
    if trained_on != signature:
        raise LadleError(
            f"base = {cfg.base!r}: {name} v{champion.version} was trained on a base with signature "
            f"{trained_on[:16] or '(none recorded)'}, but this base has signature {signature[:16]}. Point base at "
            "the base the adapter was trained on."
        )
    return signature


def on_kubernetes(uri: str, name: str, cfg: LadleConfig, champion: promote.Version, base_dir: Path) -> dict:
    """``serve.target: kubernetes``: adapter ``name``'s champion on its base's pods (``KubernetesAdapters``)."""
    from ladle.fleet.kubernetes import KubernetesAdapters, pods_base

    signature = checked_base(cfg, name, champion, base_dir)
    serve = cfg.serving()
    pods = KubernetesAdapters(front_name(signature), serve, pods_base(cfg), serve.kubernetes.tracking_uri or uri)
    return {**pods.reconcile_adapter(uri, name, champion), "base_signature": signature}


def reconcile(uri: str, name: str, cfg: LadleConfig, champion: promote.Version, base_dir: Path) -> dict:
    """Serve adapter ``name``'s champion on its base's server (see the module; ``base_dir``: the config's base as
    a local folder); what is served, as a dict.

    Raises:
        LadleError: the config's base is not the one the adapter was trained on.
        SwapFailed: the server does not serve the champion's version (the reason: the server's own words).
    """
    from ladle.assets import ladle_home
    from ladle.fleet.champion import admin_headers, current_upstream, ensure_front

    started = time.monotonic()
    serve = cfg.serving()
    signature = checked_base(cfg, name, champion, base_dir)
    base = front_name(signature)
    front = ensure_front(base, serve)
    upstream = current_upstream(front)
    action = "bound"
    if upstream is None or not records.alive(upstream):
        bindings = ladle_home() / "served" / f"{base}.adapters.json"
        extra = ["--adapter", f"{name}=models:/{name}", "--tracking-uri", uri, "--adapters-file", str(bindings)]
        extra += ["--admin-key-file", str(admin_key_file(base))]
        proc, url, log_path = start_server(base_dir, "base", serve, free_port(), extra=extra)
        try:
            wait_healthy(proc, url, serve.health_timeout_s, log_path)
        except BaseException:
            stop_process(proc, grace_s=10, group=True)
            raise
        body = {
            "url": url,
            "version": "base",
            "pid": proc.pid,
            "model_dir": str(base_dir),
            "argv": list(proc.args),
            "log": str(log_path),
            "drain_timeout_s": serve.drain_timeout_s,
            "expect_url": upstream["url"] if upstream else None,
        }
        switched = httpx.put(
            front["url"] + "/ladle/upstream",
            json=body,
            headers=admin_headers(front),
            timeout=serve.drain_timeout_s + 30,
        )
        if switched.status_code != 200:
            stop_process(proc, grace_s=10, group=True)
            raise LadleError(f"{base}: the front did not take the new server: {switched.text[:500]}", exit_code=1)
        upstream, action = current_upstream(front), "started"
    headers = {"Authorization": f"Bearer {_key(serve)}"} if serve.api_key_env else {}
    finished = None
    if cfg.promote.canary is not None:  # a verdict the front reached while nobody followed: applied first
        decided = canaries.front_canary(front, admin_headers(front), name)
        if decided is not None and decided["status"] != "running":
            finished = finish_canary(uri, name, front, upstream["url"], headers, decided)
            champion = promote.champion(uri, name) or champion
    before = served_version(upstream["url"], name, headers) if action == "bound" else None
    if before is not None:
        action = "unchanged" if before == champion.version else "swapped"
    answer = httpx.post(
        upstream["url"] + "/v1/adapters/bind",
        json={"name": name, "registered_model": name},
        headers=control_headers(base),
        timeout=300,
    )
    if answer.status_code != 200:
        raise SwapFailed(f"{name}: the server of {base} refused the binding: {answer.text[:800]}")
    state = answer.json()
    served = served_version(upstream["url"], name, headers)
    if served != champion.version:
        problem = state.get("problems", {}).get(name) or state.get("last_error") or "no reason given"
        raise SwapFailed(
            f"{name} v{champion.version} is the champion, but the server of {base} serves "
            f"{'v' + served if served else 'nothing'} under that name: {problem}"
        )
    reply = smoke(front["url"], name, serve, [{"role": "user", "content": serve.smoke_prompt or DEFAULT_SMOKE}])
    if not isinstance(reply, str):
        raise SwapFailed(f"{name} v{champion.version} answered the smoke request with {reply!r}")
    state = finished
    waiting = canaries.pending(uri, name, champion.version) if cfg.promote.canary is not None else None
    if waiting is not None:
        state = run_canary(uri, name, waiting, champion.version, cfg.promote.canary, front, upstream["url"], headers)
        champion = promote.champion(uri, name) or champion
    return {
        "model": name,
        "version": champion.version,
        "previous_version": before,
        "action": action,
        "base": base,
        "base_signature": signature,
        "front_url": front["url"],
        "server_url": upstream["url"],
        "server_pid": upstream["pid"],
        "adapters": adapters_of(upstream["url"], headers),
        "seconds": round(time.monotonic() - started, 3),
        "canary": state,
    }


def run_canary(
    uri: str,
    name: str,
    version: promote.Version,
    champion_version: str,
    limits: CanaryConfig,
    front: dict,
    server_url: str,
    headers: dict,
) -> dict:
    """The canary of adapter ``name``'s ``version`` against ``champion_version``, both held by the server at
    ``server_url`` (the registry's ``challenger`` and ``champion``): started at the base's front (or, after a crash,
    followed where it runs), judged there, then applied (``finish_canary``); its final state.

    A version the server could not load beside the champion never takes traffic: its canary is rolled back at
    once, naming the server's reason.
    """
    from ladle.fleet.champion import admin_headers

    admin = admin_headers(front)
    state = canaries.front_canary(front, admin, name)
    if state is None or state["version"] != version.version:
        problem = not_held(server_url, name, version.version, headers)
        if problem is not None:
            state = {
                "version": version.version,
                "champion_version": champion_version,
                "status": "rolled_back",
                "reason": f"v{version.version} could not be loaded on the server of its base: {problem}",
                "adapter": name,
            }
            return finish_canary(uri, name, front, server_url, headers, state)
        body = {"adapter": name, "version": version.version, "champion_version": champion_version}
        answer = httpx.put(
            front["url"] + "/ladle/canary", json={**body, "limits": limits.model_dump()}, headers=admin, timeout=30
        )
        if answer.status_code != 200:
            raise LadleError(f"{name}: the front refused the canary of v{version.version}: {answer.text[:500]}")
    state = canaries.follow(front, admin, version.version, limits.duration_s + 120, adapter=name)
    return finish_canary(uri, name, front, server_url, headers, state)


def finish_canary(uri: str, name: str, front: dict, server_url: str, headers: dict, state: dict) -> dict:
    """After the front's verdict on adapter ``name``: the registry follows it (``canary.apply``, per adapter, under
    its lock), the server reads the registry (the winner becomes the name's version, the loser is unloaded once its
    rows finish), then the front forgets the canary. Each step is idempotent, so a rerun finishes a crashed one; a
    request the front pinned to a version a sync had already unloaded is answered by the name's own version."""
    from ladle.fleet.champion import admin_headers

    canaries.apply(uri, name, state)
    synced = httpx.post(server_url + "/v1/adapters/sync", headers=control_headers(front["name"]), timeout=300)
    synced.raise_for_status()
    forgot = httpx.delete(
        front["url"] + "/ladle/canary", params={"adapter": name}, headers=admin_headers(front), timeout=10
    )
    forgot.raise_for_status()
    return state


def not_held(url: str, name: str, version: str, headers: dict) -> str | None:
    """Why the server at ``url`` does not hold ``name`` v``version`` (its own words), or None when it does."""
    listed = httpx.get(url + "/v1/adapters", headers=headers, timeout=30)
    listed.raise_for_status()
    body = listed.json()
    entry = next((a for a in body["data"] if a["name"] == name), {"versions": []})
    if any(v["version"] == version for v in entry["versions"]):
        return None
    return ((body.get("registry") or {}).get("problems") or {}).get(name) or "the server does not hold it"


def end_canary(name: str, reason: str) -> str | None:
    """Roll back adapter ``name``'s canary at whichever base's front on this machine runs one; its version, or
    None. Whoever follows it (``run_canary``) then applies the verdict."""
    from ladle.fleet.champion import admin_headers

    for path in sorted(router.records_dir().glob("base-*.json")):
        record = router.read_record(path.stem)
        if record is None:
            continue
        state = canaries.front_canary(record, admin_headers(record), name)
        if state is not None and state["status"] == "running":
            answer = httpx.request(
                "PATCH",
                record["url"] + "/ladle/canary",
                params={"reason": reason, "adapter": name},
                headers=admin_headers(record),
                timeout=10,
            )
            answer.raise_for_status()
            return state["version"]
    return None


def served_version(url: str, name: str, headers: dict) -> str | None:
    """The version the server at ``url`` answers ``name`` with (its default), or None."""
    listed = httpx.get(url + "/v1/adapters", headers=headers, timeout=30)
    listed.raise_for_status()
    entry = next((a for a in listed.json()["data"] if a["name"] == name), None)
    return entry["default"] if entry else None


def adapters_of(url: str, headers: dict) -> list[dict]:
    """Each adapter the server holds: its versions and their aliases."""
    listed = httpx.get(url + "/v1/adapters", headers=headers, timeout=30)
    listed.raise_for_status()
    return [
        {"name": a["name"], "versions": {v["version"]: v["aliases"] for v in a["versions"]}}
        for a in listed.json()["data"]
    ]


def admin_key_file(base: str) -> Path:
    """The file holding the admin key of base ``base``'s server (made once, mode 0600): the server reads it at
    every start, a restart by the front included, and ``ladle model serve`` sends it to bind and sync."""
    import contextlib
    import os
    import secrets

    from ladle.assets import ladle_home
    from ladle.platform.files import write_atomic

    path = ladle_home() / "served" / f"{base}.admin-key"
    if not path.is_file():  # written whole beside it, then linked in: of two commands at once, the first one's wins
        draft = write_atomic(path.with_name(f".{path.name}.{os.getpid()}"), secrets.token_urlsafe(32) + "\n", 0o600)
        with contextlib.suppress(FileExistsError):
            os.link(draft, path)
        draft.unlink()
    return path


def control_headers(base: str) -> dict:
    """The headers of a control route of base ``base``'s server (``ladle.serve.guard.Control``)."""
    return {"Authorization": f"Bearer {admin_key_file(base).read_text(encoding='utf-8').strip()}"}


def _key(serve) -> str:
    import os

    return os.environ[serve.api_key_env]


def holders() -> dict[str, dict]:
    """Adapter name -> {base front, server URL, versions with their aliases} for every base server on this
    machine (``ladle model list`` shows which server holds which version)."""
    found: dict[str, dict] = {}
    for path in sorted(router.records_dir().glob("base-*.json")):
        record = router.read_record(path.stem)
        if record is None:
            continue
        try:
            from ladle.fleet.champion import current_upstream

            upstream = current_upstream(record)
            if upstream is None or not records.alive(upstream):
                continue
            for entry in adapters_of(upstream["url"], {}):
                found[entry["name"]] = {
                    "base": path.stem,
                    "front_url": record["url"],
                    "server_url": upstream["url"],
                    "versions": entry["versions"],
                }
        except httpx.HTTPError:
            continue
    return found
