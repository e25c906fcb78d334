"""``ladle k8s render CONFIG --nodes N [--api trainjob|pytorchjob]``: the Kubeflow training job that trains CONFIG on
N Kubernetes nodes. ``ladle k8s render-serving MODEL [--version V]``: the objects that serve a registered version."""

from __future__ import annotations

import typer

from ladle.cli.common import CONFIG, GPUS, SET, command, load

app = typer.Typer(
    help="Kubernetes: render the multi-node training job, and the objects that serve a model.", no_args_is_help=True
)


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

    from ladle import compute
    from ladle.machine.topology import probe_file
    from ladle.plan.inputs import local_model_config
    from ladle.plan.planner import make_plan
    from ladle.platform import storage

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


@command
def render_serving(
    model: str = typer.Argument(
        ..., help="Registered model name (the config's tracking.registered_model, or its name)."
    ),
    version: str | None = typer.Option(None, "--version", help="The version to serve. Default: the `champion`."),
    config: str | None = typer.Option(
        None, "--config", "-c", help="A config or recipe whose serve.* and MLflow store to use (default: defaults)."
    ),
    uri: str | None = typer.Option(
        None, "--tracking-uri", help="MLflow tracking URI. Default: --config's store, else $MLFLOW_TRACKING_URI."
    ),
    kind: str | None = typer.Option(
        None,
        "--kind",
        help="deployment (a Deployment and a Service) or inferenceservice (KServe). Default: serve.kubernetes.kind.",
    ),
    set_: list[str] = SET,
) -> None:
    """Print the objects (YAML) that serve MODEL's VERSION on Kubernetes with ladle's server: what
    `serve.target: kubernetes` applies on each promotion or rollback."""
    import yaml

    from ladle.cli.model import tracking_uri
    from ladle.config import build_config
    from ladle.errors import LadleError
    from ladle.fleet.kubernetes import KubernetesServing
    from ladle.lifecycle import promote, tracking

    chosen = [f"serve.kubernetes.kind={kind}"] if kind else []
    if config:
        cfg = load(config, [*set_, *chosen], None)
        serve_cfg = cfg.serving()
        # The store of the config as --set left it (a moved `output` moves the default store with it).
        store = tracking_uri(uri, None) if uri else tracking.tracking_uri(cfg)[0]
    else:
        # No config: serve.* from --set on the defaults, derived as a config's are (base and data are required
        # fields that serving does not read).
        serve_cfg = build_config({"base": "-", "data": {"path": "-"}}, [*set_, *chosen]).serving()
        store = tracking_uri(uri, None)
    wanted = promote.get_version(store, model, version) if version else promote.champion(store, model)
    if wanted is None:
        raise LadleError(f"MODEL = {model!r}: it has no `champion` to serve; name one with --version V.")
    objects = KubernetesServing(model, serve_cfg).render(wanted)
    typer.echo(yaml.safe_dump_all(objects, sort_keys=False), nl=False)


app.command("render-serving")(render_serving)
