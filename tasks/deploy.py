"""Prefect task: start the inference server and check it answers."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_link_artifact

from ladle.config import ServeConfig
from ladle.data.prepare import PreparedDataset
from ladle.fleet.deploy import Endpoint, deploy
from ladle.lifecycle.evaluate import load_samples
from ladle.lifecycle.merge import MergedModel
from ladle.tasks.policy import retry_unless_user_error


@task(name="deploy-server", retries=1, retry_delay_seconds=2, retry_condition_fn=retry_unless_user_error)
def deploy_task(serving: ServeConfig, name: str, merged: MergedModel, prepared: PreparedDataset) -> Endpoint:
    endpoint = deploy(merged, serving, name, held_out=load_samples(prepared, 1))
    logger = get_run_logger()
    verdict = (
        ""
        if endpoint.expected is None
        else f" (expected {endpoint.expected!r}: {'correct' if endpoint.answer_correct else 'wrong'})"
    )
    logger.info("smoke request %r answered %r%s", endpoint.prompt, endpoint.answer, verdict)
    if endpoint.running:
        create_link_artifact(
            key="endpoint", link=endpoint.url, description=f"{endpoint.backend} server, pid {endpoint.pid}"
        )
        logger.info("server running at %s (pid %s)", endpoint.url, endpoint.pid)
    else:
        logger.info("server stopped after the smoke request (serve.keep_running=false)")
    return endpoint
