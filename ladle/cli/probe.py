"""``ladle probe [--topology-file F] [--json]``: GPUs, links and layout of this (or a recorded) machine."""

from __future__ import annotations

import typer
from rich.table import Table

from ladle.cli.common import JSON, command, console, print_json

KEYS = (
    "gpu_count",
    "interconnect",
    "all_pairs_nvlink",
    "nvlink_groups",
    "min_nvlink_bonds",
    "numa_nodes",
    "nics",
    "nodes",
    "source",
)


@command
def probe(
    topology_file: str | None = typer.Option(None, "--topology-file", help="Saved `nvidia-smi topo -m` output."),
    as_json: bool = JSON,
) -> None:
    """Show the GPUs, their interconnect and the node layout."""
    from ladle.machine.topology import probe as probe_machine
    from ladle.machine.topology import probe_file

    topo = probe_file(topology_file) if topology_file else probe_machine()
    if as_json:
        print_json(topo.model_dump())
        return
    table = Table(title="topology", show_header=False)
    for key in KEYS:
        table.add_row(key, str(getattr(topo, key)))
    console.print(table)
    if topo.links:
        matrix = Table("", *[f"GPU{i}" for i in range(topo.gpu_count)], title="links")
        for i, row in enumerate(topo.links):
            matrix.add_row(f"GPU{i}", *row)
        console.print(matrix)
    for warning in topo.warnings:
        console.print(f"[bold yellow]warning:[/] {warning}", highlight=False)
