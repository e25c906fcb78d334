"""Prefect task: resolve the run's inputs once (the base folder, the data's and the run's fingerprints, the
output store, the tracking server), for every later stage to take from it."""

from __future__ import annotations

from prefect import get_run_logger, task

from ladle.config import LadleConfig
from ladle.plan.inputs import RunInputs, resolve_inputs
from ladle.platform.secrets import redact_url
from ladle.tasks.policy import retry_unless_user_error


@task(name="resolve-inputs", retries=1, retry_delay_seconds=2, retry_condition_fn=retry_unless_user_error)
def inputs_task(cfg: LadleConfig) -> RunInputs:
    inputs = resolve_inputs(cfg)
    get_run_logger().info(
        "inputs: base %s, data fingerprint %s, run fingerprint %s, output %s, tracking %s",
        inputs.base_dir,
        inputs.data_fingerprint,
        inputs.fingerprint,
        redact_url(inputs.output),
        redact_url(inputs.tracking_uri),
    )
    return inputs
