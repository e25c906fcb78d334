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
        backends.REGISTRY.first().name, "--backend", help=" | ".join(backends.REGISTRY) + ": the inference backend."
    ),
    option: list[str] = typer.Option([], "--option", help="A backend option, NAME=VALUE (e.g. tensor_parallel=2)."),
    adapter: list[str] = typer.Option(
        [],
        "--adapter",
        help="NAME=PATH: a LoRA adapter of MODEL served unmerged beside it as OpenAI model NAME (repeatable). "
        "Requests for different adapters share one batch.",
    ),
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8000, "--port"),
    api_key_env: str | None = typer.Option(
        None,
        "--api-key-env",
        help="Environment variable holding the API key clients must send as `Authorization: Bearer` (every route "
        "but /health, /ready and /metrics). Without it the server answers anyone who can reach it.",
    ),
    admin_key_file: str | None = typer.Option(
        None,
        "--admin-key-file",
        help="File (mode 0600) holding the admin key: the credential of the control routes (adding, binding, "
        "syncing and removing adapters over HTTP), apart from the API key. Without it they are refused.",
    ),
    admin_loopback: bool = typer.Option(
        False, "--admin-loopback", help="Without --admin-key-file: allow the control routes from this machine."
    ),
    adapter_source: list[str] = typer.Option(
        [], "--adapter-source", help="A folder or store URL POST /v1/adapters may load from (repeatable)."
    ),
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
    extra += [arg for item in adapter for arg in ("--adapter", item)]
    extra += [arg for item in adapter_source for arg in ("--adapter-source", item)]
    extra += ["--admin-key-file", admin_key_file] if admin_key_file else []
    extra += ["--admin-loopback"] if admin_loopback else []
    argv = ["--model", str(folder), "--backend", kind.name, *extra, "--host", host, "--port", str(port)]
    if api_key_env:
        from ladle.serve.server import api_key_from_env

        try:
            api_key_from_env(api_key_env)  # unset: one line here, before the model loads
        except ValueError as err:
            raise LadleError(
                str(err)
                .replace("serve.api_key_env", "--api-key-env")
                .replace("set --api-key-env=null", "leave --api-key-env out")
            ) from None
        argv += ["--api-key-env", api_key_env]
    raise SystemExit(main(argv))
