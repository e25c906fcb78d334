"""The serving deployment: serve a registered model's ``champion`` behind ladle's front, swapping on change.

Its deployment trigger runs it on every ``ladle.model.promoted`` event (a promotion or a rollback) and every
``ladle.model.canary`` event (a version passed the gate and waits for its canary). Each run reconciles: it serves
whatever is ``champion`` now (so a late or repeated event does no harm), starting the front on
``serve.front_port`` if needed and swapping the version behind it without failing a request; with
``promote.canary``, it then runs the waiting version's canary to its verdict (``ladle.fleet.canary``).
"""

from __future__ import annotations

from prefect import flow, get_run_logger
from prefect.artifacts import create_link_artifact
from prefect.states import Completed

from ladle.fleet import adapters
from ladle.flows.recipe import RecipeName, recipe_config
from ladle.lifecycle import tracking
from ladle.plan.inputs import base_dir_of
from ladle.platform.secrets import install_log_redaction
from ladle.platform.startup import flow_run_process


@flow(name="serve-champion", description="Serve the registered model's champion; swap to a new one without downtime.")
def serve_champion(
    recipe: RecipeName = "tiny-cpu",
    version: str | None = None,
    front_port: int | None = None,
    overrides: list[str] | None = None,
    recipe_path: str | None = None,
    mlflow_server: str | None = None,
    artifact_store: str | None = None,
):
    """Serve the champion of the recipe's registered model.

    Args:
        recipe: The shipped recipe whose registered model (tracking.registered_model, or its name), MLflow store and serve.* settings to use.
        version: The version the triggering event announced (logged; the current champion is what gets served).
        front_port: The stable port clients use. Empty: the recipe's serve.front_port.
        overrides: Other fields as dotted `--set` strings, e.g. ["serve.max_batch_size=16"].
        recipe_path: A YAML config file to use instead of a shipped recipe.
        mlflow_server: Name of a saved ladle MlflowServer block (the registry's tracking URI).
        artifact_store: Name of a saved ladle ArtifactStore block (where the model files are, and credentials).
    """
    flow_run_process()
    install_log_redaction()
    sets = [f"serve.front_port={front_port}"] if front_port else []
    cfg = recipe_config(recipe, recipe_path, "auto", {}, [*sets, *(overrides or [])], artifact_store, mlflow_server)
    uri, _ = tracking.tracking_uri(cfg)
    name = cfg.tracking.registered_model or cfg.name
    logger = get_run_logger()
    if version:
        logger.info("event: %s v%s became champion", name, version)
    served, line = adapters.serve_registered(uri, name, cfg, lambda: base_dir_of(cfg))
    logger.info(line)
    if served["action"] != "unchanged":
        create_link_artifact(
            key="served", link=served["front_url"], description=f"{name} v{served['version']} ({served['action']})"
        )
    return Completed(message=line, data=served)
