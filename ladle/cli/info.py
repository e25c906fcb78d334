"""``ladle schema``, ``ladle env``, ``ladle plan``, ``ladle serve``: small commands."""

from __future__ import annotations

import json
import platform
import sys
from importlib import metadata

import typer

from ladle.cli.common import console, deepspeed_override, exit_with_error, fail, print_json
from ladle.errors import LadleError

PACKAGES = (
    "ladle",
    "torch",
    "transformers",
    "peft",
    "accelerate",
    "deepspeed",
    "prefect",
    "mlflow",
    "fsspec",
    "s3fs",
    "pydantic",
    "fastapi",
    "uvicorn",
)


def schema(
    markdown: bool = typer.Option(False, "--markdown", help="A reference table instead of JSON schema."),
) -> None:
    """Print the config's JSON schema (for editors), or its markdown reference."""
    from ladle.config import json_schema, markdown_reference

    print(markdown_reference() if markdown else json.dumps(json_schema(), indent=2), end="" if markdown else "\n")


def env(as_json: bool = typer.Option(False, "--json", help="One JSON object.")) -> None:
    """What a bug report needs: versions, Python, GPUs."""
    from ladle.topology import probe

    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    topo = probe()
    info = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "packages": versions,
        "topology": topo.model_dump(),
    }
    if as_json:
        print_json(info)
        return
    console.print(f"python {info['python']} on {info['platform']}")
    for name, version in versions.items():
        console.print(f"  {name:<13} {version or 'not installed'}")
    console.print(f"GPUs: {topo.gpu_count} ({topo.source}); CPU cores: {topo.cpu_count}")
    for warning in topo.warnings:
        console.print(f"[bold yellow]warning:[/] {warning}", highlight=False)


def model_size(cfg, model: dict | None) -> dict:
    """Parameter counts of the base (empty when its config.json is not at hand)."""
    from ladle.params import count_params, lora_params

    if model is None:
        return {}
    params, how = count_params(model)
    lora = cfg.training.lora
    trainable = lora_params(model, lora.r, lora.target_modules) if lora.enabled else params
    return {
        "params": params,
        "trainable_params": trainable,
        "params_counted_by": how,
        "model_type": model.get("model_type"),
    }


def plan(
    config: str = typer.Argument(..., help="YAML config file."),
    gpus: str | None = typer.Option(None, "--gpus", help="'auto' or 1..128."),
    deepspeed: str | None = typer.Option(
        None, "--deepspeed", help="zero1 | zero2 | zero3 | zero++ (alias zero_pp): sets parallelism.strategy."
    ),
    set_: list[str] = typer.Option([], "--set", help="Override a field (dotted.path=value)."),
    model_config: str | None = typer.Option(
        None, "--model-config", help="config.json (or its folder) to size the model from."
    ),
    topology_file: str | None = typer.Option(
        None, "--topology-file", help="Plan for a recorded machine (`nvidia-smi topo -m` output)."
    ),
    gpu_memory: float | None = typer.Option(
        None, "--gpu-memory", help="GiB per GPU of the recorded machine (for sizing)."
    ),
    as_json: bool = typer.Option(False, "--json", help="One JSON object."),
) -> None:
    """Validate the config against this (or a recorded) machine and show the plan, with the launch command."""
    from ladle.config import load_config
    from ladle.plan import local_model_config, make_plan
    from ladle.topology import probe, probe_file

    if gpu_memory is not None and not (0 < gpu_memory <= 4096):
        exit_with_error(
            f"--gpu-memory = {gpu_memory}: GiB per GPU must be in (0, 4096], e.g. --gpu-memory 80.", as_json
        )
    size: dict = {}
    try:
        cfg = load_config(config, [*deepspeed_override(deepspeed), *set_], gpus)
        model = local_model_config(cfg, model_config)
        size = model_size(cfg, model)
        topo = probe_file(topology_file, gpu_memory_gib=gpu_memory) if topology_file else probe()
        made = make_plan(cfg, topo, config, model=model)
    except LadleError as err:
        fail(err, as_json, **size)
    command = made.launch_command(["SPEC.json"])
    if as_json:
        print_json({**made.model_dump(mode="json"), **size, "launch_command": command})
        return
    console.print(made.to_markdown(), highlight=False)
    if size:
        console.print(
            f"model: {size['model_type']}, {size['params']:,} parameters ({size['params_counted_by']}), "
            f"{size['trainable_params']:,} trainable",
            highlight=False,
        )
    console.print(f"launch: {command}", highlight=False, soft_wrap=True)


def serve(
    model: str = typer.Argument(..., help="Merged model folder (local path or fsspec URL)."),
    backend: str = typer.Option("transformers", "--backend", help="transformers | mii"),
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8000, "--port"),
) -> None:
    """Serve a model folder over the OpenAI-compatible API until interrupted."""
    from ladle.serve.__main__ import main

    if backend not in ("transformers", "mii"):
        exit_with_error(f"--backend = {backend!r}: unknown backend. Use transformers or mii.")
    try:
        from ladle.assets import resolve_base

        folder = resolve_base(model)
    except LadleError as err:
        exit_with_error(str(err).replace("base =", "MODEL ="))
    raise SystemExit(main(["--model", str(folder), "--backend", backend, "--host", host, "--port", str(port)]))
