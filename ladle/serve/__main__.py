"""``python -m ladle.serve --model DIR [--backend NAME] [--option K=V ...] [--host H] [--port P]``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ladle.errors import LadleError
from ladle.platform.startup import quiet_collector
from ladle.serve import backends, engine_side, records


def draining_server_class():
    import signal

    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, except that a SIGTERM ends the process with status 0 once in-flight requests
        are drained (uvicorn re-raises the signal after its graceful shutdown, which exits -15)."""

        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            if sig == signal.SIGTERM and sig in self._captured_signals:
                self._captured_signals.remove(sig)  # a requested, drained stop: not a crash

    return Server


def local_model(model: str, sha256: str | None):
    """The model folder on local disk: ``model`` itself, or its copy when it is a URL of the artifact store (a
    server pod on Kubernetes serves a registered version straight from the store)."""
    import hashlib

    from ladle.assets import ladle_home
    from ladle.platform import storage

    if storage.is_local(model):
        return storage.local_path(model)
    try:
        key = storage.cache_key(sha256 or hashlib.sha256(model.encode()).hexdigest(), "--model-sha256")
        verified = sha256 if sha256 and storage.FULL_DIGEST.fullmatch(sha256) else None
        return storage.cached_copy(model, ladle_home() / "served" / key, verified)
    except (OSError, ValueError) as exc:
        raise LadleError(f"--model {model}: could not copy it from the artifact store: {exc}") from None


def one_thread_until_fork() -> None:
    """Before torch loads: OpenMP starts no worker thread in this process (``OMP_NUM_THREADS=1``), so the engine
    process can be forked from it with every library imported and no thread's lock copied; the engine process
    sets its own thread count back (``ENGINE_THREADS``: the user's ``OMP_NUM_THREADS``, else torch's default of
    one per physical core this process may run on)."""
    import os

    if "torch" in sys.modules or engine_side.ENGINE_THREADS in os.environ:
        return
    asked = os.environ.get("OMP_NUM_THREADS")
    if asked is None:
        import psutil

        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        asked = str(max(1, min(cores, psutil.cpu_count(logical=False) or cores)))
    os.environ[engine_side.ENGINE_THREADS] = asked
    os.environ["OMP_NUM_THREADS"] = "1"


def main(argv: list[str] | None = None) -> int:
    import setproctitle

    setproctitle.getproctitle()  # set up before anything changes the environment: the engine renames itself
    one_thread_until_fork()
    args = parser().parse_args(argv)
    with quiet_collector():  # the imports and the model's load build long-lived objects: none scanned again
        started = start(args)
    if isinstance(started, int):
        return started
    return run(args, *started)


def parser() -> argparse.ArgumentParser:
    """The server's command line (what a pod's arguments must parse by, too)."""
    parser = argparse.ArgumentParser(
        prog="python -m ladle.serve", description="Serve a model folder over an OpenAI-compatible API."
    )
    parser.add_argument(
        "--model",
        required=True,
        help="Hugging Face model folder: a local path, or a URL of the artifact store (s3://..., copied once into "
        "ladle's home and served from there).",
    )
    parser.add_argument(
        "--model-sha256", default=None, help="The model's hash (a registered version's), which keys the local copy."
    )
    parser.add_argument("--name", default=None, help="Model id reported by the API (default: the folder name).")
    parser.add_argument("--backend", default=next(iter(backends.REGISTRY)), choices=list(backends.REGISTRY))
    parser.add_argument("--option", action="append", default=[], help="A backend option, NAME=VALUE (repeatable).")
    parser.add_argument(
        "--adapter",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="A LoRA adapter served beside the model, unmerged, as OpenAI model NAME (repeatable; a local folder or a "
        "store URL). More can be added while serving: POST /v1/adapters.",
    )
    parser.add_argument(
        "--adapters-file",
        default=None,
        help="JSON file of adapter name -> registered model bindings, read at start and added to by "
        "POST /v1/adapters/bind (a restart with the same command serves the same adapters).",
    )
    parser.add_argument(
        "--tracking-uri",
        default=None,
        help="The MLflow store whose aliases registry-bound adapters follow (default: $MLFLOW_TRACKING_URI).",
    )
    parser.add_argument(
        "--adapter-sync-s",
        type=float,
        default=10.0,
        help="Seconds between reads of the registry's aliases; 0: only at start and on POST /v1/adapters/sync.",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-new-tokens", type=int, default=32, help="Default max_tokens of a request.")
    parser.add_argument("--api-key-env", default=None, help="Environment variable holding the API key.")
    parser.add_argument(
        "--admin-key-file",
        default=None,
        help="File holding the admin key (its first line): the credential of the control routes (POST and DELETE "
        "/v1/adapters, /bind, /sync), apart from the API key. Without it (and without --admin-loopback) they are "
        "refused.",
    )
    parser.add_argument(
        "--admin-loopback",
        action="store_true",
        help="Without --admin-key-file: allow the control routes to clients on this machine, without a key.",
    )
    parser.add_argument(
        "--adapter-source",
        action="append",
        default=[],
        metavar="PREFIX",
        help="A folder or store URL that POST /v1/adapters may load adapters from (repeatable; none: it loads none).",
    )
    parser.add_argument("--drain-timeout", type=float, default=30.0, help="Seconds SIGTERM waits for requests.")
    parser.add_argument(
        "--limits", default="{}", help="serve.limits as JSON (what one request may ask; its defaults when left out)."
    )
    parser.add_argument(
        "--capture",
        default="{}",
        help='serve.capture as JSON: {"enabled": true} records each answered request (redacted) and takes '
        "POST /v1/feedback, into ./traffic unless its url says where.",
    )
    parser.add_argument(
        "--model-version", default=None, help="The registered version served (captured traffic is partitioned by it)."
    )
    return parser


def start(args: argparse.Namespace):
    """The backend and app from ``args``; an exit code after an error it printed."""
    from ladle.serve.capture import CaptureSettings
    from ladle.serve.guard import Control
    from ladle.serve.limits import ServeLimits
    from ladle.serve.server import Settings, admin_key_from_file, api_key_from_env, create_app

    try:
        limits = section_of(ServeLimits, args.limits, "--limits", "limits")
        capture = section_of(CaptureSettings, args.capture, "--capture", "capture")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        key = api_key_from_env(args.api_key_env)
        control = Control(admin_key_from_file(args.admin_key_file), args.admin_loopback)
        kind = backends.get(args.backend)
        model = local_model(args.model, args.model_sha256)
        if not (Path(model) / "config.json").is_file():
            what = "is not a model folder (it has no config.json)" if Path(model).is_dir() else "does not exist"
            raise LadleError(f"--model {args.model}: {what}. Give a Hugging Face model folder or its URL in the store.")
        name = args.name or args.model.rstrip("/").rsplit("/", 1)[-1]
        check_adapters(args.adapter, model, name, kind)  # a bad --adapter: one line before the base loads
        backend = kind.start(str(model), **kind.parse_options(args.option))
    except (LadleError, ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        catalog, sync = served_adapters(backend, name, args)
    except (LadleError, ValueError, OSError) as err:
        backend.close()
        print(f"error: {err}", file=sys.stderr)
        return 2
    settings = Settings(
        name, args.max_new_tokens, key, limits, control, tuple(args.adapter_source), capture, args.model_version
    )
    app = create_app(backend, settings, catalog, sync)
    return backend, app, name, model


def section_of(kind, text: str, flag: str, field: str):
    """``serve.FIELD`` from a flag's JSON.

    Raises:
        ValueError: naming the flag, the field and the problem.
    """
    from pydantic import ValidationError

    try:
        return kind.model_validate_json(text)
    except ValidationError as exc:
        problem = exc.errors()[0]
        where = ".".join(str(p) for p in problem["loc"])
        raise ValueError(f"{flag}: serve.{field}.{where}: {problem['msg']}") from None


def check_adapters(items: list[str], model: str | Path, name: str, kind) -> None:
    """Each ``--adapter NAME=PATH`` item's form, name and folder, checked against the base's weights as their
    files' headers list them (nothing loaded): what ``served_adapters`` would refuse after the load.

    Raises:
        LadleError: a malformed item, a bad name, or a folder that is no LoRA adapter of this base.
    """
    if not items:
        return
    from ladle.serve.adapter_sync import parse_binding
    from ladle.serve.adapters import BaseWeights, Catalog, inspect
    from ladle.serve.server import adapter_folder

    base = BaseWeights.of(model)
    names = Catalog(name, base if kind.serves_adapters else None)
    for item in items:
        adapter, path = adapter_item(item)
        names.check_name(adapter)
        if parse_binding(item) is None:
            inspect(adapter_folder(path), base)


def adapter_item(item: str) -> tuple[str, str]:
    """``NAME=PATH`` (or ``NAME=models:/REGISTERED``) split in two.

    Raises:
        LadleError: not of that form.
    """
    adapter, sep, path = item.partition("=")
    if not sep or not adapter or not path:
        raise LadleError(f"--adapter {item!r}: expected NAME=PATH or NAME=models:/REGISTERED_MODEL.")
    return adapter, path


def served_adapters(backend, name: str, args: argparse.Namespace):
    """The catalog of the ``--adapter`` items (``NAME=PATH``: checked against the base and registered with the
    engine; ``NAME=models:/REGISTERED``: bound to a registered model) and, with bindings, the registry sync that
    serves their aliased versions (run once before the server answers, then every ``--adapter-sync-s``).

    Raises:
        LadleError: a malformed item, a backend without adapters, or an adapter folder that does not fit the base.
    """
    import os

    from ladle.serve.adapter_sync import Bindings, RegistrySync, parse_binding
    from ladle.serve.adapters import BaseWeights, Catalog
    from ladle.serve.server import adapter_folder

    catalog = Catalog(name, BaseWeights.of(backend.model_dir) if backend.serves_adapters else None)
    bound = {}
    for item in args.adapter:
        adapter, path = adapter_item(item)
        catalog.check_name(adapter)
        binding = parse_binding(item)
        if binding is not None:
            bound[binding[0]] = binding[1]
            continue
        version, _ = catalog.add(adapter, str(adapter_folder(path)))
        backend.add_adapter(version.key, version.info.path, version.info.bytes)
    uri = args.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not (bound or args.adapters_file or args.tracking_uri):
        return catalog, None
    if uri is None:
        raise LadleError("--adapter NAME=models:/...: no MLflow store; pass --tracking-uri or set MLFLOW_TRACKING_URI.")
    bindings = Bindings(args.adapters_file, bound)
    for adapter, _ in bindings.items():
        catalog.check_name(adapter)
    sync = RegistrySync(catalog, backend, uri, bindings, args.adapter_sync_s)
    sync.once()  # before the first request: what the registry says, or /ready names what is missing
    sync.start()
    return catalog, sync


def run(args: argparse.Namespace, backend, app, name: str, model) -> int:
    """Serve ``app`` until SIGTERM (drained) or SIGINT; the record is written first and removed last."""
    import uvicorn

    record = records.write(f"http://{args.host}:{args.port}", name, args.backend, str(model))
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level="warning",
        access_log=True,
        timeout_graceful_shutdown=args.drain_timeout,
    )
    server = draining_server_class()(config)
    died = []

    def engine_died() -> None:  # the engine process is gone: stop serving, and exit non-zero to be restarted
        died.append(True)
        server.should_exit = True

    backend.on_death = engine_died
    try:
        server.run()
    finally:
        record.unlink(missing_ok=True)
        backend.close()
        if getattr(app.state, "capture", None) is not None:  # what waits is written (bounded)
            app.state.capture.close()
    return 1 if died else 0


if __name__ == "__main__":
    sys.exit(main())
