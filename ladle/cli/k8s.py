"""``ladle k8s render CONFIG --nodes N [--api trainjob|pytorchjob]``: the Kubeflow training job that trains CONFIG on
N Kubernetes nodes."""

from __future__ import annotations

import typer

from ladle.cli.common import CONFIG, GPUS, SET, command, load

app = typer.Typer(help="Kubernetes: render the multi-node training job.", no_args_is_help=True)


@command
def render(
    config: str = CONFIG,
    nodes: int = typer.Option(..., "--nodes", min=1, max=1024, help="Kubernetes nodes (one pod each)."),
    gpus: str | None = GPUS,
    set_: list[str] = SET,
    topology_file: str | None = typer.Option(
        None, "--topology-file", help="One node's `nvidia-smi topo -m` output (default: probe this machine)."
    ),
    gpu_memory: float | None = typer.Option(None, "--gpu-memory", help="GiB per GPU of that node (for sizing)."),
    spec: str | None = typer.Option(
        None,
        "--spec",
        help="The spec.json the pods read. Default: where a pipeline run named --run-id writes it in `output`.",
    ),
    run_id: str | None = typer.Option(None, "--run-id", help="The run's name (default: the config's `name`)."),
    api: str | None = typer.Option(
        None,
        "--api",
        help="pytorchjob (Kubeflow training operator) or trainjob (Kubeflow Trainer v2: the TrainJob and the "
        "ClusterTrainingRuntime it references). Default: compute.kubernetes.api.",
    ),
) -> None:
    """Print the training job (YAML) for CONFIG planned on NODES nodes like the one probed or recorded."""
    import yaml

    from ladle import compute, storage
    from ladle.inputs import local_model_config
    from ladle.plan import make_plan
    from ladle.topology import probe_file

    chosen = [f"compute.kubernetes.api={api}"] if api else []
    cfg = load(config, [*set_, "compute.target=kubernetes", f"parallelism.nodes={nodes}", *chosen], gpus)
    target = compute.get(cfg)
    topo = probe_file(topology_file, gpu_memory_gib=gpu_memory) if topology_file else target.probe()
    made = make_plan(cfg, topo, config, model=local_model_config(cfg, None))
    name = run_id or cfg.name
    spec_url = spec or storage.join(storage.normalise(cfg.output), "runs", name, "spec.json")
    if cfg.compute.kubernetes.api == "trainjob":
        typer.echo(yaml.safe_dump_all(target.render_trainjob(spec_url, made, name), sort_keys=False), nl=False)
    else:
        typer.echo(yaml.safe_dump(target.render(spec_url, made, name), sort_keys=False), nl=False)


app.command("render")(render)
