"""``python -m ladle.serve --model DIR [--backend NAME] [--option K=V ...] [--host H] [--port P]``."""

from __future__ import annotations

import argparse
import sys

from ladle.errors import LadleError
from ladle.serve import backends, records


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ladle.serve", description="Serve a model folder over an OpenAI-compatible API."
    )
    parser.add_argument("--model", required=True, help="Local Hugging Face model folder.")
    parser.add_argument("--name", default=None, help="Model id reported by the API (default: the folder name).")
    parser.add_argument("--backend", default=next(iter(backends.REGISTRY)), choices=list(backends.REGISTRY))
    parser.add_argument("--option", action="append", default=[], help="A backend option, NAME=VALUE (repeatable).")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-new-tokens", type=int, default=32, help="Default max_tokens of a request.")
    parser.add_argument("--api-key-env", default=None, help="Environment variable holding the API key.")
    parser.add_argument("--drain-timeout", type=float, default=30.0, help="Seconds SIGTERM waits for requests.")
    args = parser.parse_args(argv)
    import uvicorn

    from ladle.serve.server import Settings, api_key_from_env, create_app

    try:
        key = api_key_from_env(args.api_key_env)
        kind = backends.get(args.backend)
        backend = kind.start(args.model, **kind.parse_options(args.option))
    except (LadleError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    name = args.name or args.model.rstrip("/").rsplit("/", 1)[-1]
    app = create_app(backend, Settings(name, args.max_new_tokens, key))
    record = records.write(f"http://{args.host}:{args.port}", name, args.backend, args.model)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level="warning",
        access_log=True,
        timeout_graceful_shutdown=args.drain_timeout,
    )
    try:
        draining_server_class()(config).run()
    finally:
        record.unlink(missing_ok=True)
        backend.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
