"""`nvidia-smi topo -m` parsing: matrices written in the tool's layout (links, NIC columns, affinity columns)."""

from __future__ import annotations

import pytest

from ladle.errors import LadleError
from ladle.machine.topo_matrix import cliques, parse
from tests.helpers import CONSUMER_2, NVSWITCH_8, PAIRS_4, PCIE_8, full, matrix

MIXED_4 = matrix(
    [["X", "NV2", "NV1", "SYS"], ["NV2", "X", "NV1", "NV2"], ["NV1", "NV1", "X", "NV2"], ["SYS", "NV2", "NV2", "X"]]
)
MLX = matrix(
    full(2, "NV12"), nics={"mlx5_0": ["PIX", "SYS"], "mlx5_1": ["SYS", "PIX"]}, affinity=[("0-7", "0"), ("8-15", "1")]
)


def facts(topo) -> tuple:
    """What the planner reads from a matrix."""
    return topo.gpu_count, topo.interconnect, topo.nvlink_groups, topo.min_nvlink_bonds, topo.numa_nodes, topo.nics


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
    assert facts(topo) == (count, interconnect, groups, bonds, numa, nics)
    assert topo.all_pairs_nvlink == (interconnect == "nvswitch")
    assert all(topo.links[i][i] == "X" for i in range(count))


# Grace Hopper (4x GH200, NVLink between all): each GPU's NUMA Affinity is a list (its CPU's node,
# then its memory and MIG nodes) and GPU NUMA ID is the GPU memory's own node.
GH200_4 = matrix(
    full(4, "NV6"),
    affinity=[(f"{72 * i}-{72 * i + 71}", f"{i},{4 + 8 * i}-{11 + 8 * i}") for i in range(4)],
    gpu_numa=[str(4 + 8 * i) for i in range(4)],
)


def test_grace_hopper_numa_lists_and_gpu_numa_id():
    assert parse(GH200_4).numa_nodes == [4, 12, 20, 28]  # GPU NUMA ID wins when it is a number
    without_id = (
        GH200_4.replace("\t4\n", "\tN/A\n")
        .replace("\t12\n", "\tN/A\n")
        .replace("\t20\n", "\tN/A\n")
        .replace("\t28\n", "\tN/A\n")
    )
    assert parse(without_id).numa_nodes == [0, 1, 2, 3]  # else the affinity list's first node (the CPU's)
    assert parse(GH200_4).interconnect == "nvswitch"


# Real pastes from public issue threads, verbatim (tests/machine/topo_pastes/):
REAL_PASTES = {
    # https://github.com/NVIDIA/go-gpuallocator/issues/17 : 8x RTX 4090, two sockets, two NICs
    "rtx4090-8-go-gpuallocator-17.txt": (8, "pcie", [], None, [0, 1], ["NIC0", "NIC1"]),
    # https://github.com/noonghunna/club-3090/issues/1229 : 2x RTX 5090 on one socket, with the legend
    "rtx5090-2-club-3090-1229.txt": (2, "pcie", [], None, [0], []),
}


@pytest.mark.parametrize("name", sorted(REAL_PASTES))
def test_real_pastes(name):
    from pathlib import Path

    assert facts(parse((Path(__file__).parent / "topo_pastes" / name).read_text())) == REAL_PASTES[name]


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
