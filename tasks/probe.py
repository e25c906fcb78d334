"""Prefect task: probe the machine's GPUs and layout."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact

from ladle import compute
from ladle.config import LadleConfig
from ladle.machine.topology import Topology
from ladle.tasks.policy import retry_unless_user_error


@task(
    name="probe-topology",
    retries=1,
    retry_delay_seconds=2,
    retry_condition_fn=retry_unless_user_error,
    timeout_seconds=900,  # a Slurm probe may wait in the queue
)
def probe_task(cfg: LadleConfig) -> Topology:
    """The topology of a machine training will run on: this one, or one node of the compute target."""
    topo = compute.get(cfg).probe()
    logger = get_run_logger()
    for warning in topo.warnings:
        logger.warning(warning)
    rows = [
        {"index": g.index, "name": g.name, "memory_mib": g.memory_mib, "compute_capability": g.compute_capability}
        for g in topo.gpus
    ]
    summary = [
        {
            "gpu_count": topo.gpu_count,
            "interconnect": topo.interconnect,
            "nodes": topo.nodes,
            "cpu_count": topo.cpu_count,
        }
    ]
    create_table_artifact(
        key="topology", table=rows or summary, description=f"Topology ({topo.source}): {topo.gpu_count} GPU(s)"
    )
    return topo
