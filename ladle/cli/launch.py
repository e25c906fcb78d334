"""``ladle launch SPEC --node-rank R``: join a multi-node training run from another machine."""

from __future__ import annotations

import typer

from ladle.cli.common import exit_with_error
from ladle.errors import LadleError


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

    try:
        if not storage.exists(spec):
            raise LadleError(f"SPEC = {spec!r}: no such file. Pass the spec.json path printed by the train stage.")
        nodes = TrainSpec.model_validate_json(storage.read_bytes(spec)).plan.num_machines
    except ValidationError:
        exit_with_error(f"SPEC = {spec!r}: not a ladle training spec.")
    except LadleError as err:
        exit_with_error(str(err))
    if node_rank >= nodes:
        exit_with_error(f"--node-rank = {node_rank}: the run has {nodes} node(s), so ranks are 1..{nodes - 1}.")
    raise SystemExit(run_node(spec, node_rank))
