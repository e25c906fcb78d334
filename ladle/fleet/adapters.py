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
4. the server must then serve the champion's version under the adapter's name, and answer a request for it.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from ladle.config import LadleConfig
from ladle.errors import LadleError
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
        served = reconcile(uri, name, cfg, wanted, Path(base_dir()))
        line = (
            f"{name} v{served['version']}: served on {served['base']} ({served['action']}) at {served['front_url']} "
            f"as model {name!r}; that server holds {len(served['adapters'])} adapter(s)"
        )
        return served, line
    served = champion.reconcile(uri, name, cfg.serving(), cfg.promote.canary)
    return served.model_dump(), served.message()


def front_name(signature: str) -> str:
    return f"base-{signature[:12]}"


def reconcile(uri: str, name: str, cfg: LadleConfig, champion: promote.Version, base_dir: Path) -> dict:
    """Serve adapter ``name``'s champion on its base's server (see the module; ``base_dir``: the config's base as
    a local folder); what is served, as a dict.

    Raises:
        LadleError: the config's base is not the one the adapter was trained on.
        SwapFailed: the server does not serve the champion's version (the reason: the server's own words).
    """
    from ladle.assets import ladle_home
    from ladle.fleet.champion import admin_headers, current_upstream, ensure_front
    from ladle.lifecycle.copies import base_signature

    started = time.monotonic()
    serve = cfg.serving()
    trained_on = champion.tags.get("ladle.base_signature", "")
    signature = base_signature(base_dir)
    if trained_on != signature:
        raise LadleError(
            f"base = {cfg.base!r}: {name} v{champion.version} was trained on a base with signature "
            f"{trained_on[:16] or '(none recorded)'}, but this base has signature {signature[:16]}. Point base at "
            "the base the adapter was trained on."
        )
    base = front_name(signature)
    front = ensure_front(base, serve)
    upstream = current_upstream(front)
    action = "bound"
    if upstream is None or not records.alive(upstream):
        bindings = ladle_home() / "served" / f"{base}.adapters.json"
        extra = ["--adapter", f"{name}=models:/{name}", "--tracking-uri", uri, "--adapters-file", str(bindings)]
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
    before = served_version(upstream["url"], name, headers) if action == "bound" else None
    if before is not None:
        action = "unchanged" if before == champion.version else "swapped"
    answer = httpx.post(
        upstream["url"] + "/v1/adapters/bind",
        json={"name": name, "registered_model": name},
        headers=headers,
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
    }


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
