"""Entry point for deployments and schedules: a recipe path plus overrides and block names."""

from __future__ import annotations

from prefect import flow

from ladle.config import LadleConfig, load_config
from ladle.flows.finetune import finetune


def apply_blocks(
    cfg: LadleConfig, artifact_store: str | None, mlflow_server: str | None, compute: str | None
) -> LadleConfig:
    """Overlay the named Prefect blocks on the config: store URL, tracking URI, GPUs.

    A block named here is an explicit choice, so it wins over the recipe's value.
    """
    from ladle.blocks import ArtifactStore, ComputeTarget, MlflowServer

    tree = cfg.model_dump()
    if artifact_store:
        store = ArtifactStore.load(artifact_store)
        store.export_env()
        tree["output"] = store.url
    if mlflow_server:
        server = MlflowServer.load(mlflow_server)
        tree["tracking"].update(uri=server.tracking_uri, ui_url=server.ui_url or server.tracking_uri)
    if compute:
        target = ComputeTarget.load(compute)
        tree["parallelism"].update(gpus=target.gpus, cpu_processes=target.cpu_processes)
    return LadleConfig.model_validate(tree)


@flow(name="finetune-recipe", description="Run the fine-tune pipeline on a recipe file, with overrides.")
def finetune_recipe(
    recipe: str = "tiny-cpu",
    gpus: str = "auto",
    overrides: list[str] | None = None,
    artifact_store: str | None = None,
    mlflow_server: str | None = None,
    compute: str | None = None,
) -> dict:
    """Load ``recipe`` (a YAML path relative to the working directory, or a shipped recipe name), apply ``--set``-style overrides and blocks, run.

    Args:
        recipe: path of the YAML config, or the name of a shipped recipe (`ladle recipes list`).
        gpus: 'auto' or 1..128.
        overrides: dotted overrides, e.g. ["training.max_steps=50"].
        artifact_store / mlflow_server / compute: names of saved ladle blocks.
    """
    cfg = load_config(recipe, overrides or [], gpus)
    cfg = apply_blocks(cfg, artifact_store, mlflow_server, compute)
    return finetune(cfg, config_ref=recipe)
