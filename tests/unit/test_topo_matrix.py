"""`nvidia-smi topo -m` parsing: matrices written in the tool's layout (links, NIC columns, affinity columns)."""

from __future__ import annotations

import pytest

from ladle.errors import LadleError
from ladle.topo_matrix import cliques, parse

LEGEND = """
Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node
  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)
  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)
  PIX  = Connection traversing at most a single PCIe bridge
  NV#  = Connection traversing a bonded set of # NVLinks
"""


def matrix(links: list[list[str]], nics: dict[str, list[str]] | None = None, affinity: list[tuple[str, str]] | None = None,
           gpu_numa: bool = False, sep: str = "\t") -> str:  # fmt: skip
    """Render a matrix the way nvidia-smi lays it out."""
    n = len(links)
    nics = nics or {}
    names = [f"GPU{i}" for i in range(n)] + list(nics)
    header = [""] + names + (["CPU Affinity", "NUMA Affinity"] if affinity else []) + (["GPU NUMA ID"] if gpu_numa else [])
    lines = [sep.join(header)]
    for i, row in enumerate(links):
        cells = [f"GPU{i}", *row, *[nics[k][i] for k in nics]]
        if affinity:
            cells += list(affinity[i])
        if gpu_numa:
            cells.append("N/A")
        lines.append(sep.join(cells))
    for k, col in nics.items():
        lines.append(sep.join([k, *col, *["X" if k == j else "SYS" for j in nics]]))
    return "\n".join(lines) + "\n" + LEGEND


def full(n: int, code: str) -> list[list[str]]:
    return [["X" if i == j else code for j in range(n)] for i in range(n)]


NVSWITCH_8 = matrix(full(8, "NV18"), nics={f"NIC{k}": ["PXB" if i // 2 == k else "SYS" for i in range(8)] for k in range(4)},
                    affinity=[("0-47,96-143", "0")] * 4 + [("48-95,144-191", "1")] * 4, gpu_numa=True)  # fmt: skip
PAIRS_4 = matrix([["X", "NV4", "PHB", "PHB"], ["NV4", "X", "PHB", "PHB"], ["PHB", "PHB", "X", "NV4"], ["PHB", "PHB", "NV4", "X"]],
                 affinity=[("0-15", "0")] * 2 + [("16-31", "1")] * 2)  # fmt: skip
PCIE_8 = matrix([["X" if i == j else "NODE" if i // 4 == j // 4 else "SYS" for j in range(8)] for i in range(8)],
                affinity=[("0-23", "0")] * 4 + [("24-47", "1")] * 4, sep="    ")  # fmt: skip
CONSUMER_2 = matrix(full(2, "PHB"), affinity=[("0-15", "N/A")] * 2)
MIXED_4 = matrix([["X", "NV2", "NV1", "SYS"], ["NV2", "X", "NV1", "NV2"], ["NV1", "NV1", "X", "NV2"], ["SYS", "NV2", "NV2", "X"]])
MLX = matrix(full(2, "NV12"), nics={"mlx5_0": ["PIX", "SYS"], "mlx5_1": ["SYS", "PIX"]}, affinity=[("0-7", "0"), ("8-15", "1")])


@pytest.mark.parametrize(
    "text, count, interconnect, groups, bonds, numa, nics",
    [
        (NVSWITCH_8, 8, "nvswitch", [list(range(8))], 18, [0, 1], ["NIC0", "NIC1", "NIC2", "NIC3"]),
        (PAIRS_4, 4, "partial-nvlink", [[0, 1], [2, 3]], 4, [0, 1], []),
        (PCIE_8, 8, "pcie", [], None, [0, 1], []),
        (CONSUMER_2, 2, "pcie", [], None, None, []),
        (MIXED_4, 4, "partial-nvlink", [[0, 1, 2], [1, 2, 3]], 1, None, []),
        (MLX, 2, "nvswitch", [[0, 1]], 12, [0, 1], ["mlx5_0", "mlx5_1"]),
    ],
    ids=["nvswitch-8", "nvlink-pairs-4", "pcie-8", "consumer-2", "mixed-4", "mlx-columns"],
)
def test_facts(text, count, interconnect, groups, bonds, numa, nics):
    topo = parse(text)
    assert (topo.gpu_count, topo.interconnect, topo.nvlink_groups, topo.min_nvlink_bonds, topo.numa_nodes, topo.nics) == (
        count, interconnect, groups, bonds, numa, nics)  # fmt: skip
    assert topo.all_pairs_nvlink == (interconnect == "nvswitch")
    assert all(topo.links[i][i] == "X" for i in range(count))


def test_ansi_codes_with_and_without_esc_byte_and_indentation():
    coloured = NVSWITCH_8.replace("GPU0\t", "\x1b[4mGPU0\x1b[0m\t", 1).replace("NV18", "[32mNV18[0m", 5)
    indented = "\n".join("    " + line for line in coloured.splitlines())
    assert parse(indented) == parse(NVSWITCH_8)


def test_missing_legend_and_squashed_spaces():
    squashed = PAIRS_4.split("Legend")[0].replace("\t", " ")
    assert parse(squashed) == parse(PAIRS_4)


def test_not_a_matrix():
    with pytest.raises(LadleError, match="no header line starting with GPU0"):
        parse("Sun Nov 22 nvidia-smi: command not found\n")
    with pytest.raises(LadleError, match="row GPU1 has links"):
        parse("\tGPU0\tGPU1\nGPU0\tX\tNV2\nGPU1\tNV2\n")


def test_cliques():
    assert cliques(4, {(0, 1), (1, 2), (0, 2), (2, 3)}) == [[0, 1, 2], [2, 3]]
    assert cliques(3, set()) == []
