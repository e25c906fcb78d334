"""The NVML probe, read through a recorded NVML (the machines this host lacks): the same facts as the
`nvidia-smi topo -m` matrix of the same machine, CUDA_VISIBLE_DEVICES respected."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ladle.machine.topo_matrix import parse
from ladle.machine.topology import probe
from tests.helpers import CONSUMER_2, NVSWITCH_8, PAIRS_4


class NVMLError(Exception):
    pass


class RecordedNVML:
    """The pynvml calls the probe makes, answering from a recorded machine.

    ``links[i]`` lists GPU i's enabled NVLinks as remote targets: a GPU index, or "switch".
    ``ancestor[i][j]`` is the NVML topology level of a pair without NVLink.
    """

    NVML_FEATURE_ENABLED = 1
    NVMLError = NVMLError

    def __init__(
        self, name: str, memory_gib: int, cc: tuple[int, int], links: list[list], ancestor: list[list[int]] | None
    ):
        self.name, self.memory, self.cc, self.links, self.ancestor = name, memory_gib * 2**30, cc, links, ancestor

    def nvmlDeviceGetCount(self):
        return len(self.links)

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return self.name.encode()  # older bindings return bytes

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(total=self.memory)

    def nvmlDeviceGetCudaComputeCapability(self, h):
        return self.cc

    def nvmlDeviceGetPciInfo(self, h):
        return SimpleNamespace(busId=f"00000000:{0x10 + h:02X}:00.0")

    def _link(self, h, link):
        if not self.links[h] or link >= len(self.links[h]):
            raise NVMLError("NotSupported" if not self.links[h] else "InvalidArgument")
        return self.links[h][link]

    def nvmlDeviceGetNvLinkState(self, h, link):
        self._link(h, link)
        return 1

    def nvmlDeviceGetNvLinkRemotePciInfo_v2(self, h, link):
        target = self._link(h, link)
        return SimpleNamespace(busId="00000000:C0:00.0" if target == "switch" else f"00000000:{0x10 + target:02X}:00.0")

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, h, link):
        return 2 if self._link(h, link) == "switch" else 0

    def nvmlDeviceGetTopologyCommonAncestor(self, a, b):
        return self.ancestor[a][b]


H100_SXM = RecordedNVML("NVIDIA H100 80GB HBM3", 80, (9, 0), [["switch"] * 18 for _ in range(8)], None)
BRIDGED_4 = RecordedNVML(
    "NVIDIA RTX A6000",
    48,
    (8, 6),
    [[1] * 4, [0] * 4, [3] * 4, [2] * 4],
    [[0, 0, 30, 30], [0, 0, 30, 30], [30, 30, 0, 0], [30, 30, 0, 0]],
)
CONSUMER = RecordedNVML("NVIDIA GeForce RTX 4090", 24, (8, 9), [[], []], [[0, 30], [30, 0]])

FACTS = ("gpu_count", "links", "all_pairs_nvlink", "nvlink_groups", "min_nvlink_bonds", "interconnect")


@pytest.mark.parametrize(
    ("nvml", "matrix"),
    [(H100_SXM, NVSWITCH_8), (BRIDGED_4, PAIRS_4), (CONSUMER, CONSUMER_2)],
    ids=["nvswitch-8", "bridged-pairs-4", "consumer-2"],
)
def test_nvml_gives_the_same_facts_as_the_matrix(nvml, matrix):
    topo = probe(env={}, nvml=nvml)
    expected = parse(matrix).model_dump()
    assert topo.source == "nvml" and topo.cuda_available
    assert {k: getattr(topo, k) for k in FACTS} == {k: expected[k] for k in FACTS}
    assert topo.gpus[0].name == nvml.name and topo.gpus[0].memory_mib == nvml.memory // 2**20
    assert topo.gpus[0].compute_capability == f"{nvml.cc[0]}.{nvml.cc[1]}"


def test_cuda_visible_devices_narrows_the_nvml_view():
    topo = probe(env={"CUDA_VISIBLE_DEVICES": "2,3"}, nvml=BRIDGED_4)
    assert topo.gpu_count == 2 and topo.links == [["X", "NV4"], ["NV4", "X"]] and topo.interconnect == "nvswitch"
    split = probe(env={"CUDA_VISIBLE_DEVICES": "1,2"}, nvml=BRIDGED_4)
    assert split.links == [["X", "PHB"], ["PHB", "X"]] and split.interconnect == "pcie"
