"""``ladle serve MODEL``: serve a model folder over the OpenAI-compatible API until interrupted."""

from __future__ import annotations

import typer

from ladle.cli.common import command
from ladle.errors import LadleError
from ladle.serve import backends


@command
def serve(
    model: str = typer.Argument(..., help="Merged model folder (local path or fsspec URL)."),
    backend: str = typer.Option(
        next(iter(backends.REGISTRY)), "--backend", help=" | ".join(backends.REGISTRY) + ": the inference backend."
    ),
    option: list[str] = typer.Option([], "--option", help="A backend option, NAME=VALUE (e.g. tensor_parallel=2)."),
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8000, "--port"),
) -> None:
    """Serve a model folder over the OpenAI-compatible API until interrupted."""
    from ladle.assets import resolve_base
    from ladle.serve.__main__ import main

    kind = backends.get(backend)
    kind.parse_options(option)  # a bad option is one line here, before anything loads
    try:
        folder = resolve_base(model)
    except LadleError as err:
        raise LadleError(str(err).replace("base =", "MODEL =")) from None
    extra = [arg for item in option for arg in ("--option", item)]
    argv = ["--model", str(folder), "--backend", kind.name, *extra, "--host", host, "--port", str(port)]
    raise SystemExit(main(argv))
