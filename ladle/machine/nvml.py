"""GPU facts from NVML (nvidia-ml-py), the probe's first choice on a GPU host.

Per GPU: name, total memory, compute capability. Per pair: the NVLink links
between them (counted link by link from each GPU's NVLink state and remote
PCI bus id; a link to an NVSwitch joins its GPU to every other GPU that
reaches a switch), and otherwise their PCIe/CPU common ancestor, written in
`nvidia-smi topo -m`'s codes so both sources derive the same facts
(``ladle.machine.topo_matrix.facts``).
"""

from __future__ import annotations

from typing import Any

# nvmlDeviceGetTopologyCommonAncestor levels -> `nvidia-smi topo -m` codes
ANCESTOR = {0: "PIX", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
MAX_LINKS = 18  # NVML_NVLINK_MAX_LINKS
REMOTE_SWITCH = 2  # NVML_NVLINK_DEVICE_TYPE_SWITCH


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def load() -> Any | None:
    """The initialised ``pynvml`` module, or None without the package or a driver."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...: no usable GPU driver here
        return None
    return pynvml


def read(nvml: Any) -> tuple[list[dict], list[list[str]]]:
    """Every GPU NVML sees (NVML/PCI order) and the link matrix between them."""
    count = nvml.nvmlDeviceGetCount()
    handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    gpus, bus_ids = [], []
    for index, handle in enumerate(handles):
        major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
        gpus.append(
            {
                "index": index,
                "name": _text(nvml.nvmlDeviceGetName(handle)),
                "memory_mib": int(nvml.nvmlDeviceGetMemoryInfo(handle).total) // 2**20,
                "compute_capability": f"{major}.{minor}",
            }
        )
        bus_ids.append(_text(nvml.nvmlDeviceGetPciInfo(handle).busId).lower())
    direct = [[0] * count for _ in range(count)]
    to_switch = [0] * count
    for i, handle in enumerate(handles):
        for link in range(MAX_LINKS):
            try:
                if nvml.nvmlDeviceGetNvLinkState(handle, link) != nvml.NVML_FEATURE_ENABLED:
                    continue
                remote = _text(nvml.nvmlDeviceGetNvLinkRemotePciInfo_v2(handle, link).busId).lower()
                kind = nvml.nvmlDeviceGetNvLinkRemoteDeviceType(handle, link)
            except nvml.NVMLError:
                break  # no NVLink on this GPU, or no link with this number
            if kind == REMOTE_SWITCH or remote not in bus_ids:
                to_switch[i] += 1
            else:
                direct[i][bus_ids.index(remote)] += 1
    links = [["X"] * count for _ in range(count)]
    for i in range(count):
        for j in range(count):
            if i == j:
                continue
            bonds = direct[i][j] + (min(to_switch[i], to_switch[j]) if to_switch[i] and to_switch[j] else 0)
            if bonds:
                links[i][j] = f"NV{bonds}"
            else:
                level = nvml.nvmlDeviceGetTopologyCommonAncestor(handles[i], handles[j])
                links[i][j] = ANCESTOR.get(int(level), "SYS")
    return gpus, links
