"""``ladle launch SPEC --node-rank R``: join a multi-node training run from another machine."""

from __future__ import annotations

import typer

from ladle.cli.common import command
from ladle.errors import LadleError


@command
def launch(
    spec: str = typer.Argument(..., help="The run's spec.json (local path or URL), as printed by the train stage."),
    node_rank: int = typer.Option(
        ..., "--node-rank", min=1, help="This machine's rank, 1..nodes-1 (node 0 runs the pipeline)."
    ),
) -> None:
    """Start this machine's training processes and wait for them."""
    from pydantic import ValidationError

    from ladle import storage
    from ladle.train.run import run_node
    from ladle.train.spec import TrainSpec

    if not storage.exists(spec):
        raise LadleError(f"SPEC = {spec!r}: no such file. Pass the spec.json path printed by the train stage.")
    try:
        nodes = TrainSpec.model_validate_json(storage.read_bytes(spec)).plan.num_machines
    except ValidationError:
        raise LadleError(f"SPEC = {spec!r}: not a ladle training spec.") from None
    if node_rank >= nodes:
        raise LadleError(f"--node-rank = {node_rank}: the run has {nodes} node(s), so ranks are 1..{nodes - 1}.")
    raise SystemExit(run_node(spec, node_rank))
