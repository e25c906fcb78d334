"""Entry points for deployments, schedules and the Prefect UI: typed parameters over a shipped recipe.

Every parameter has a type and a description, so the Prefect UI renders a form and ``prefect deployment
run ... --params`` / ``-p`` take the same fields. A typed field left empty keeps the recipe's value;
``overrides`` (dotted ``--set`` strings) are applied after them, for anything the form does not show.
"""

from __future__ import annotations

import json
from typing import Literal

from prefect import flow, get_run_logger
from prefect.states import Completed

from ladle.assets import shipped_recipes
from ladle.config import LadleConfig, load_config
from ladle.flows.finetune import finetune
from ladle.lifecycle.tracking import strip_credentials
from ladle.platform.startup import flow_run_process

RecipeName = Literal[tuple(shipped_recipes())]  # the shipped recipes, as the form's choices
TYPED = {
    "data_path": "data.path",
    "objective": "training.objective",
    "max_steps": "training.max_steps",
    "lr": "training.lr",
    "lora_r": "training.lora.r",
    "promote_metric": "promote.metric",
    "min_improvement": "promote.min_improvement",
}


def apply_blocks(
    cfg: LadleConfig, artifact_store: str | None, mlflow_server: str | None, compute: str | None
) -> LadleConfig:
    """Overlay the named Prefect blocks on the config: store URL, tracking URI, GPUs, nodes and compute target.

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
        # A password in the URI is kept by this process for that server, not in the config.
        uri = strip_credentials(server.tracking_uri.get_secret_value())
        tree["tracking"].update(uri=uri, ui_url=server.ui_url or uri)
    if compute:
        ComputeTarget.load(compute).overlay(tree)
    return LadleConfig.model_validate(tree)


def recipe_config(
    recipe: str,
    recipe_path: str | None,
    gpus: str | int,
    typed: dict,
    overrides: list[str] | None,
    artifact_store: str | None = None,
    mlflow_server: str | None = None,
    compute: str | None = None,
) -> LadleConfig:
    """The config a deployment run means: recipe (or file), typed fields, then overrides, then blocks."""
    sets = [f"{TYPED[k]}={json.dumps(v)}" for k, v in typed.items() if v is not None]  # JSON is YAML: values stay typed
    cfg = load_config(recipe_path or recipe, [*sets, *(overrides or [])], str(gpus))
    for note in cfg.notes:  # e.g. the recipe's held-out file set aside for the user's own data
        get_run_logger().warning(note)
    return apply_blocks(cfg, artifact_store, mlflow_server, compute)


@flow(name="finetune-recipe", description="Fine-tune, evaluate, gate and promote a shipped recipe, with overrides.")
def finetune_recipe(
    recipe: RecipeName = "tiny-cpu",
    gpus: Literal["auto"] | int = "auto",
    data_path: str | None = None,
    objective: Literal["sft", "dpo", "kto", "grpo"] | None = None,
    max_steps: int | None = None,
    lr: float | None = None,
    lora_r: int | None = None,
    promote_metric: str | None = None,
    min_improvement: float | None = None,
    run_id: str | None = None,
    skip_if_data_unchanged: bool = False,
    overrides: list[str] | None = None,
    recipe_path: str | None = None,
    artifact_store: str | None = None,
    mlflow_server: str | None = None,
    compute: str | None = None,
):
    """Run the pipeline on a recipe; the typed fields override its values, empty ones keep them.

    Args:
        recipe: A shipped recipe (`ladle recipes list`); its YAML is the starting config.
        gpus: 'auto' (every GPU the machine has, planned) or a count, 1..128.
        data_path: Training data: a file, folder, glob or fsspec URL (s3://bucket/train/*.jsonl). Empty: the recipe's.
        objective: `sft` (conversations), `dpo` (preference pairs: chosen and rejected) or `grpo` (prompts, scored by the recipe's rewards). Empty: the recipe's.
        max_steps: Optimizer steps (-1: `training.epochs` passes). Empty: the recipe's.
        lr: Peak learning rate. Empty: the recipe's.
        lora_r: LoRA rank. Empty: the recipe's.
        promote_metric: Metric the promotion gate compares: `loss` or the recipe's eval.metric. Empty: eval.metric.
        min_improvement: How much the new model must beat the champion by, in the metric's units. Empty: the recipe's.
        run_id: Name of the run's folder. Giving the id of a run that crashed or was cancelled resumes it from its last complete checkpoint.
        skip_if_data_unchanged: End at once, Completed and 'skipped', when the champion was trained from the same data, base weights and training settings (one fingerprint).
        overrides: Any other field as dotted `--set` strings, applied after the typed fields, e.g. ["training.warmup_steps=10"].
        recipe_path: A YAML config file to use instead of a shipped recipe (relative to the worker's directory).
        artifact_store: Name of a saved ladle ArtifactStore block (output URL and its credentials).
        mlflow_server: Name of a saved ladle MlflowServer block (tracking URI).
        compute: Name of a saved ladle ComputeTarget block (target, nodes, GPUs, CPU processes, Slurm or
            Kubernetes options).
    """
    flow_run_process()
    typed = {
        "data_path": data_path,
        "objective": objective,
        "max_steps": max_steps,
        "lr": lr,
        "lora_r": lora_r,
        "promote_metric": promote_metric,
        "min_improvement": min_improvement,
    }
    cfg = recipe_config(recipe, recipe_path, gpus, typed, overrides, artifact_store, mlflow_server, compute)
    state = finetune(
        cfg,
        config_ref=recipe_path or recipe,
        run_id=run_id,
        skip_if_data_unchanged=skip_if_data_unchanged,
        return_state=True,
    )
    # Its message ("promoted: ...", "not promoted: ...", "skipped: ...") becomes this run's; a failure raises.
    return Completed(message=state.message, data=state.result())
