"""``ladle launch SPEC [--node-rank R]``: start one machine's share of a multi-node training run.

By hand (``compute.target: local``), node 0 runs the pipeline and each other machine runs this with its
``--node-rank``. Under a scheduler (``slurm``, ``kubernetes``) every node runs it, node 0 included, with the
rank and the rendezvous the scheduler chose: ``--node-rank`` defaults to ``$SLURM_NODEID``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import typer

from ladle.cli.common import command
from ladle.errors import LadleError
from ladle.train.preempt import PREEMPTED


def node_rank_from_env() -> int:
    value = os.environ.get("SLURM_NODEID", "")
    if not value.isdigit():
        raise LadleError("--node-rank: not given and $SLURM_NODEID is not set. Pass this machine's node rank.")
    return int(value)


@command
def launch(
    spec: str = typer.Argument(..., help="The run's spec.json (local path or URL), as printed by the train stage."),
    node_rank: int | None = typer.Option(
        None,
        "--node-rank",
        min=0,
        help="This machine's rank, 1..nodes-1 when joining by hand (node 0 runs the pipeline); "
        "under a scheduler 0..nodes-1. Default: $SLURM_NODEID.",
    ),
    main_address: str | None = typer.Option(
        None, "--main-address", help="Rendezvous address (node 0's), when a scheduler chose the nodes."
    ),
    main_port: int | None = typer.Option(None, "--main-port", min=1, max=65535, help="Rendezvous port on node 0."),
    stopped_file: str | None = typer.Option(
        None,
        "--stopped-file",
        help="When this node's ranks were told to stop and checkpointed, write this file and exit 0 instead of 75 "
        "(the Slurm batch script's way to requeue without srun taking the first 75 for a crash).",
    ),
    print_command: bool = typer.Option(
        False, "--print-command", help="Print the node's launch argv (JSON) instead of running it."
    ),
) -> None:
    """Start this machine's training processes and wait for them."""
    from pydantic import ValidationError

    from ladle.platform import storage
    from ladle.train.run import run_node
    from ladle.train.spec import TrainSpec

    if not storage.exists(spec):
        raise LadleError(f"SPEC = {spec!r}: no such file. Pass the spec.json path printed by the train stage.")
    try:
        parsed = TrainSpec.model_validate_json(storage.read_bytes(spec))
    except ValidationError:
        raise LadleError(f"SPEC = {spec!r}: not a ladle training spec.") from None
    nodes, target = parsed.plan.num_machines, parsed.config.compute.target
    rank = node_rank_from_env() if node_rank is None else node_rank
    first = 0 if target != "local" else 1
    if not first <= rank < nodes:
        where = "node 0 runs the pipeline, so " if first else ""
        raise LadleError(f"--node-rank = {rank}: the run has {nodes} node(s); {where}ranks are {first}..{nodes - 1}.")
    if print_command:
        argv = parsed.plan.launcher_argv([spec], machine_rank=rank, main_address=main_address, main_port=main_port)
        print(json.dumps(argv))
        return
    # A scheduler stops a job with SIGTERM: make it an exception, so this node's ranks are stopped with it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    code = run_node(spec, rank, main_address=main_address, main_port=main_port)
    if code == PREEMPTED and stopped_file:
        # Under `srun --kill-on-bad-exit`, the first node to exit 75 would have the others killed while they still
        # wind down, and srun would report their SIGTERM (143), not 75. Exit 0 and leave the word in a file instead.
        Path(stopped_file).write_text(f"node {rank}: checkpointed when told to stop\n", encoding="utf-8")
        code = 0
    raise SystemExit(code)
