"""Adapters bound to registered models: a server serves what the registry's aliases say, never what a process
remembers.

A binding names an adapter (the OpenAI ``model`` a client sends) and the registered model whose versions it serves
(``--adapter support-bot=models:/support-bot``). For each binding the server holds the version aliased
``champion`` (addressed as ``support-bot``, ``support-bot@champion`` and ``support-bot@vN``) and the one aliased
``challenger`` (``support-bot@challenger``), nothing else. It reads the aliases when it starts, every
``serve.adapters.sync_s``, and when told (``POST /v1/adapters/sync``, which ``ladle model serve`` calls after a
promotion or a rollback): a new champion is fetched from the store (its weights checked against the version's
``ladle.model_sha256``), checked against the base, and loaded beside the old one, which finishes the requests it
runs and is unloaded. So a restarted server, a second replica and a pod on Kubernetes serve the same versions.

A version that cannot be served (its files missing or altered, trained on another base, not an adapter) is named by
``/ready`` (503), so a load balancer stops sending this replica traffic, while the adapters that did load keep
answering whoever still reaches it; the version it replaced keeps serving its name. A registry that cannot be reached
changes nothing: what is loaded keeps serving, and the next sync tries again (``GET /v1/adapters`` says when the
last one succeeded).

The bindings live in a file (``--adapters-file``) that ``POST /v1/adapters/bind`` adds to, so a restart with the
same command line serves the same adapters.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

from ladle.errors import LadleError
from ladle.serve.adapters import Catalog

PREFIX = "models:/"


def parse_binding(item: str) -> tuple[str, str] | None:
    """``NAME=models:/REGISTERED`` as (name, registered model); None for ``NAME=PATH`` (a folder).

    Raises:
        LadleError: a ``models:/`` reference with an alias or version in it (the server follows the aliases).
    """
    name, _, target = item.partition("=")
    if not target.startswith(PREFIX):
        return None
    registered = target.removeprefix(PREFIX).strip("/")
    if not registered or "@" in registered or "/" in registered:
        raise LadleError(
            f"--adapter {item!r}: name a registered model, models:/NAME; the server serves its champion and "
            "challenger as the registry's aliases say (no @alias or /version here)."
        )
    return name, registered


class Bindings:
    """Adapter name -> registered model, kept in a JSON file when one is given (a restart reads it back)."""

    def __init__(self, path: str | None, given: dict[str, str]):
        self.path = Path(path) if path else None
        self.lock = threading.Lock()
        stored = json.loads(self.path.read_text(encoding="utf-8")) if self.path and self.path.is_file() else {}
        self.map: dict[str, str] = {**stored, **given}
        self.save()

    def add(self, name: str, registered: str) -> None:
        """Raises: LadleError: ``MAX_VERSIONS`` bindings already (each serves up to two versions)."""
        from ladle.serve.adapters import MAX_VERSIONS

        with self.lock:
            if name not in self.map and 2 * (len(self.map) + 1) > MAX_VERSIONS:
                raise LadleError(f"adapter {name}: this server follows {len(self.map)} registered models, its most.")
            self.map[name] = registered
        self.save()

    def items(self) -> list[tuple[str, str]]:
        with self.lock:
            return sorted(self.map.items())

    def save(self) -> None:
        if self.path is None:
            return
        from ladle.platform.files import write_atomic

        with self.lock:  # written whole through a file of its own, inside the lock: two saves never share a draft
            write_atomic(self.path, json.dumps(self.map, indent=1, sort_keys=True))


class RegistrySync:
    """Makes the catalog's registry-bound adapters equal to the registry's ``champion`` and ``challenger``."""

    def __init__(self, catalog: Catalog, backend, uri: str | None, bindings: Bindings, every_s: float = 10.0):
        self.catalog, self.backend, self.uri, self.bindings, self.every_s = catalog, backend, uri, bindings, every_s
        self.lock = threading.Lock()  # one sync at a time: the timer's and a POST's
        self.last_ok: float | None = None
        self.last_error: str | None = None
        self.last_pass = time.monotonic()  # when a pass last ended, ok or not (``stalled``)
        self.wake = threading.Event()

    def start(self) -> None:
        """The periodic sync; none when ``every_s`` is 0 or less (the aliases are then read at start and when told:
        a Kubernetes pod, whose versions change by rollouts)."""
        if self.every_s <= 0:
            return
        threading.Thread(target=self.loop, name="ladle-adapter-sync", daemon=True).start()

    def loop(self) -> None:
        while True:
            self.wake.wait(self.every_s)
            self.wake.clear()
            try:
                self.once()
            except Exception:  # noqa: BLE001 - the thread must outlive any one pass; once() records its own errors
                logging.getLogger("ladle.serve").exception("adapter sync: a pass failed; the next one tries again")

    def stalled(self) -> str | None:
        """Why the periodic sync is not keeping up (no pass has ended for three periods, a minute at least), or
        None: ``/ready`` turns red with it, as a replica that no longer follows the registry is not what it says."""
        if self.every_s <= 0:
            return None
        late = time.monotonic() - self.last_pass
        if late <= max(3 * self.every_s, 60.0):
            return None
        return (
            f"the adapter sync has not finished a pass for {late:.0f} s (every {self.every_s:g} s); restart the server"
        )

    def state(self) -> dict:
        return {
            "tracking_uri": self.uri,
            "bindings": dict(self.bindings.items()),
            "every_s": self.every_s,
            "last_ok": self.last_ok,
            "last_error": self.last_error,
            "problems": dict(self.catalog.problems),
        }

    def once(self) -> dict:
        """One pass over every binding; returns ``state``. Never raises: a failure is recorded and reported."""
        with self.lock:
            errors = []
            for name, registered in self.bindings.items():
                try:
                    self.sync(name, registered)
                except LadleError as exc:  # the registry: what is loaded keeps serving
                    errors.append(f"{name} (models:/{registered}): {exc}")
                except Exception as exc:  # noqa: BLE001 - a credential error, a race with DELETE: the same
                    errors.append(f"{name} (models:/{registered}): {type(exc).__name__}: {exc}")
            if errors:
                self.last_error = "; ".join(errors)[:4000]
            else:
                self.last_ok, self.last_error = time.time(), None
            self.last_pass = time.monotonic()
            return self.state()

    def sync(self, name: str, registered: str) -> None:
        """Raises: LadleError: the registry failed."""
        from ladle.lifecycle import promote

        if self.uri is None:
            raise LadleError("no MLflow store: start the server with --tracking-uri or set MLFLOW_TRACKING_URI.")
        wanted = promote.aliased(self.uri, registered)  # alias -> Version (champion, challenger)
        by_version: dict[str, set[str]] = {}
        for alias, version in wanted.items():
            by_version.setdefault(version.version, set()).add(alias)
        have = self.catalog.labels(name)
        problems = []
        for number, aliases in sorted(by_version.items(), key=lambda item: "champion" not in item[1]):
            version = next(v for v in wanted.values() if v.version == number)
            default = "champion" in aliases
            if number in have:
                self.catalog.relabel(name, number, aliases, default)
                continue
            try:
                folder = self.fetch(version)
                added, dropped = self.catalog.add(name, str(folder), number, sorted(aliases), default, self.tell_engine)
            except Exception as exc:  # noqa: BLE001 - a bad adapter_config.json or weights file: this version's problem
                why = str(exc) if isinstance(exc, LadleError) else f"{type(exc).__name__}: {exc}"
                problems.append(f"{name} v{number} ({', '.join(sorted(aliases))}) of models:/{registered}: {why}")
                continue
            for key in dropped:
                self.backend.drop_adapter(key)
        served = self.catalog.labels(name)
        champion_served = any("champion" in by_version.get(n, ()) for n in served)
        for number in set(served) - set(by_version):
            if not champion_served and self.catalog.default.get(name) == number:
                # The new champion cannot be served: the old one keeps answering the name (under no alias) until
                # it can, and /ready names the problem.
                self.catalog.relabel(name, number, set(), default=True)
                continue
            for key in self.catalog.remove(name, number):
                self.backend.drop_adapter(key)
        if problems:
            self.catalog.problems[name] = "; ".join(problems)
        else:
            self.catalog.problems.pop(name, None)
        if not wanted:
            self.catalog.problems[name] = f"models:/{registered} has no champion or challenger to serve"

    def tell_engine(self, version) -> None:
        self.backend.add_adapter(version.key, version.info.path, version.info.bytes)

    def fetch(self, version) -> Path:
        """The version's folder on local disk, its weights checked against its ``ladle.model_sha256``.

        Raises:
            LadleError: not an adapter, or its files cannot be copied or do not match.
        """
        from ladle.lifecycle.copies import model_dir_of

        if version.tags.get("ladle.kind") != "adapter":
            raise LadleError(
                "a merged model, not an adapter: serve it on a server of its own (`ladle model serve` of its config)"
            )
        from ladle.platform import storage

        try:
            folder = model_dir_of(version)
        except (OSError, ValueError) as exc:
            raise LadleError(f"its files could not be fetched: {exc}") from None
        tagged = version.tags.get("ladle.model_sha256", "")
        if storage.is_local(version.source) and storage.FULL_DIGEST.fullmatch(tagged):  # a store's copy was checked
            found = storage.weights_hash(folder)
            if found != tagged:
                raise LadleError(
                    f"its weights at {version.source} hash to {found[:16]}, not the registered {tagged[:16]} "
                    "(ladle.model_sha256): they changed since it was registered"
                )
        return folder
