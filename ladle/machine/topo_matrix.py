"""Parse ``nvidia-smi topo -m`` text into the facts the planner needs.

Tolerates what real pastes look like: tabs or runs of spaces, ANSI colour
codes with or without their ESC byte, indented or squashed lines, NIC rows
and columns (``NIC#`` or ``mlx5_*``), CPU/NUMA affinity and GPU NUMA ID
columns when present, and a missing legend. Pure Python (no torch).
"""

from __future__ import annotations

import re
from itertools import combinations

from pydantic import BaseModel, Field

from ladle.errors import LadleError

ANSI = re.compile(r"(?:\x1b)?\[[0-9;]*m")
DEVICE = re.compile(r"^(GPU\d+|NIC\d+|mlx\d+_\d+|mlx\d+_bond_\d+)$")
LINK = re.compile(r"^(X|NV\d+|PIX|PXB|PHB|NODE|SYS|SOC)$")
MULTIWORD = {"CPU Affinity": "CPU_Affinity", "NUMA Affinity": "NUMA_Affinity", "GPU NUMA ID": "GPU_NUMA_ID"}


class TopoMatrix(BaseModel):
    gpu_count: int
    links: list[list[str]] = Field(description="GPU x GPU link codes; 'X' on the diagonal.")
    all_pairs_nvlink: bool
    nvlink_groups: list[list[int]] = Field(description="Maximal sets of GPUs in which every pair is NV#.")
    min_nvlink_bonds: int | None
    numa_nodes: list[int] | None
    nics: list[str]
    interconnect: str = Field(description="nvswitch (all pairs NVLink), partial-nvlink, pcie or none.")


def _clean(text: str) -> list[str]:
    text = ANSI.sub("", text.replace("\r", ""))
    for phrase, token in MULTIWORD.items():
        text = re.sub(r"\s+".join(map(re.escape, phrase.split())), token, text)
    return [line.strip() for line in text.splitlines() if line.strip()]


def _header(lines: list[str]) -> tuple[int, list[str]]:
    for index, line in enumerate(lines):
        tokens = line.split()
        if tokens and tokens[0] == "GPU0" and len(tokens) > 1 and not LINK.match(tokens[1]):
            return index, tokens
    raise LadleError("topology: no header line starting with GPU0 (is this `nvidia-smi topo -m` output?).")


def parse(text: str) -> TopoMatrix:
    """Facts from ``nvidia-smi topo -m`` output.

    Raises:
        LadleError: no matrix found, or a GPU row whose links do not fit the header.
    """
    lines = _clean(text)
    start, header = _header(lines)
    devices = [t for t in header if DEVICE.match(t)]
    extra = header[len(devices) :]
    rows: dict[str, list[str]] = {}
    for line in lines[start + 1 :]:
        tokens = line.split()
        if not tokens or tokens[0] not in devices:
            continue
        links = tokens[1 : 1 + len(devices)]
        if len(links) < len(devices) or not all(LINK.match(t) for t in links):
            raise LadleError(f"topology: row {tokens[0]} has links {links} for columns {devices}.")
        rows[tokens[0]] = tokens[1:]
    gpus = [d for d in devices if d.startswith("GPU") and d in rows]
    if not gpus:
        raise LadleError("topology: no GPU rows under the header.")
    gpu_cols = [devices.index(g) for g in gpus]
    links = [[rows[g][c] for c in gpu_cols] for g in gpus]
    numa = _numa(rows, gpus, len(devices), extra)
    return facts(links, numa, [d for d in devices if not d.startswith("GPU")])


def _numa(rows: dict[str, list[str]], gpus: list[str], width: int, extra: list[str]) -> list[int] | None:
    """The GPUs' NUMA nodes: each GPU's ``GPU NUMA ID`` when it is a number, else its ``NUMA Affinity``.

    On Grace Hopper/Blackwell the GPU's memory is its own NUMA node (``GPU NUMA ID``)
    and ``NUMA Affinity`` is a list such as ``0,5-11``: the CPU's node first, then
    the GPU memory and MIG nodes. So the affinity counts by its first node; on x86
    hosts ``GPU NUMA ID`` is ``N/A`` and the affinity is a single node.
    """
    nodes = {node for g in gpus if (node := _gpu_numa(rows[g], width, extra)) is not None}
    return sorted(nodes) or None


def _cell(row: list[str], width: int, extra: list[str], name: str) -> str | None:
    if name not in extra:
        return None
    column = width + extra.index(name)
    return row[column] if len(row) > column else None


def _gpu_numa(row: list[str], width: int, extra: list[str]) -> int | None:
    own = _cell(row, width, extra, "GPU_NUMA_ID")
    if own is not None and own.isdigit():
        return int(own)
    affinity = _cell(row, width, extra, "NUMA_Affinity") or ""
    first = re.match(r"^(\d+)(?:[,-]|$)", affinity)
    return int(first.group(1)) if first else None


def facts(links: list[list[str]], numa: list[int] | None, nics: list[str]) -> TopoMatrix:
    """Derive the planner's facts from a GPU link matrix."""
    n = len(links)
    pairs = list(combinations(range(n), 2))
    nv = {(i, j) for i, j in pairs if links[i][j].startswith("NV")}
    bonds = [int(links[i][j][2:]) for i, j in nv]
    all_nv = n > 1 and len(nv) == len(pairs)
    interconnect = "none" if n < 2 else "nvswitch" if all_nv else "partial-nvlink" if nv else "pcie"
    return TopoMatrix(
        gpu_count=n,
        links=links,
        all_pairs_nvlink=all_nv,
        nvlink_groups=cliques(n, nv),
        min_nvlink_bonds=min(bonds) if bonds else None,
        numa_nodes=numa,
        nics=nics,
        interconnect=interconnect,
    )


def cliques(n: int, edges: set[tuple[int, int]]) -> list[list[int]]:
    """Maximal cliques of size >= 2 (Bron-Kerbosch with pivoting), each sorted, sorted overall."""
    neighbours = {v: set() for v in range(n)}
    for i, j in edges:
        neighbours[i].add(j)
        neighbours[j].add(i)
    found: list[list[int]] = []

    def expand(r: set[int], p: set[int], x: set[int]) -> None:
        if not p and not x:
            if len(r) >= 2:
                found.append(sorted(r))
            return
        pivot = max(p | x, key=lambda v: len(neighbours[v] & p))
        for v in list(p - neighbours[pivot]):
            expand(r | {v}, p & neighbours[v], x & neighbours[v])
            p = p - {v}
            x = x | {v}

    expand(set(), set(range(n)), set())
    return sorted(found)
