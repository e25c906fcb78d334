"""Probe the machine: GPUs, their memory, and the launcher's node layout.

Imports neither torch nor NVML bindings at module load, so ``ladle probe`` and
``ladle plan`` start fast. GPUs are read from NVML when nvidia-ml-py and a
driver are present, else from ``nvidia-smi``'s CSV query and ``topo -m``
matrix; a host with neither (or with no GPU) is a CPU host, reported with a
warning.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping
from typing import Literal

from pydantic import BaseModel, Field

from ladle.errors import LadleError

NVIDIA_SMI_QUERY = ["--query-gpu=index,name,memory.total,compute_cap", "--format=csv,noheader,nounits"]


class GPU(BaseModel):
    index: int
    name: str
    memory_mib: int = Field(description="Total memory in MiB.")
    compute_capability: str | None = None


class Topology(BaseModel):
    gpu_count: int = Field(description="GPUs visible to this process (after CUDA_VISIBLE_DEVICES).")
    gpus: list[GPU] = Field(default_factory=list)
    cuda_available: bool
    interconnect: Literal["nvswitch", "partial-nvlink", "pcie", "none", "unknown"] = Field(
        description="GPU-to-GPU links; `none` without GPUs, `unknown` when not probed."
    )
    nodes: int = Field(1, description="Machines taking part (from the launcher environment).")
    node_rank: int = Field(0, description="This machine's rank among the nodes.")
    cpu_count: int = Field(description="CPU cores usable by this process.")
    source: str = Field(description="Where the facts came from: nvidia-smi, file:<path>, none.")
    links: list[list[str]] = Field(default_factory=list, description="GPU x GPU link codes from `nvidia-smi topo -m`.")
    all_pairs_nvlink: bool = False
    nvlink_groups: list[list[int]] = Field(default_factory=list, description="Maximal all-NVLink GPU sets.")
    min_nvlink_bonds: int | None = None
    numa_nodes: list[int] | None = None
    nics: list[str] = Field(default_factory=list)
    warnings: list[str] = Field(default_factory=list)


def parse_gpu_query(text: str) -> list[GPU]:
    """Parse ``nvidia-smi --query-gpu=index,name,memory.total,compute_cap --format=csv,noheader,nounits``.

    Raises:
        LadleError: a line does not have the expected four fields.
    """
    gpus = []
    for line in text.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 3 or not parts[0].isdigit():
            raise LadleError(f"nvidia-smi output line {line!r}: expected 'index, name, memory, compute_cap'.")
        memory = int(float(parts[2])) if parts[2].replace(".", "", 1).isdigit() else 0
        cap = parts[3] if len(parts) > 3 and parts[3] not in ("", "[N/A]") else None
        gpus.append(GPU(index=int(parts[0]), name=parts[1], memory_mib=memory, compute_capability=cap))
    return gpus


def visible(gpus: list[GPU], env: dict[str, str]) -> list[GPU]:
    """Keep the GPUs that ``CUDA_VISIBLE_DEVICES`` exposes, in its order (by index)."""
    spec = env.get("CUDA_VISIBLE_DEVICES")
    if spec is None:
        return gpus
    by_index = {str(g.index): g for g in gpus}
    picked = []
    for item in (s.strip() for s in spec.split(",")):
        if item not in by_index:
            break  # CUDA stops at the first invalid entry
        picked.append(by_index[item])
    return picked


def node_layout(env: dict[str, str]) -> tuple[int, int]:
    """Nodes and this node's rank from the launcher environment (torchrun / accelerate / SLURM)."""
    nodes = env.get("NNODES") or env.get("SLURM_NNODES") or "1"
    rank = env.get("NODE_RANK") or env.get("GROUP_RANK") or env.get("SLURM_NODEID") or "0"
    return (int(nodes) if nodes.isdigit() else 1), (int(rank) if rank.isdigit() else 0)


def usable_cores(env: Mapping[str, str]) -> int:
    """The CPU cores this task may use: Slurm's allotment (``SLURM_CPUS_PER_TASK``), else the affinity mask
    (a container's or cgroup's), else the machine's count."""
    slurm = env.get("SLURM_CPUS_PER_TASK", "")
    if slurm.isdigit():
        return int(slurm)
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def run_nvidia_smi() -> str | None:
    """The GPU query output, or None when nvidia-smi is missing or finds no GPU."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        done = subprocess.run([exe, *NVIDIA_SMI_QUERY], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 and done.stdout.strip() else None


def with_matrix(topo: Topology, text: str) -> Topology:
    """Add the link facts of ``nvidia-smi topo -m`` output to ``topo``."""
    from ladle.machine.topo_matrix import parse

    matrix = parse(text)
    return topo.model_copy(update={k: v for k, v in matrix.model_dump().items() if k != "gpu_count"})


def probe_file(
    path: str, env: dict[str, str] | None = None, gpu_memory_gib: float | None = None, gpu_name: str = "recorded GPU"
) -> Topology:
    """A recorded machine: ``nvidia-smi topo -m`` output saved to a file (plus, for sizing, each GPU's memory,
    which the matrix does not record).

    Raises:
        LadleError: the file is missing or holds no topology matrix.
    """
    from pathlib import Path

    from ladle.machine.topo_matrix import parse

    file = Path(path)
    if not file.is_file():
        raise LadleError(f"--topology-file = {path!r}: no such file. Save `nvidia-smi topo -m` output to it.")
    text = file.read_text(encoding="utf-8", errors="replace")
    matrix = parse(text)
    nodes, node_rank = node_layout(dict(os.environ if env is None else env))
    base = Topology(
        gpu_count=matrix.gpu_count,
        cuda_available=True,
        interconnect=matrix.interconnect,
        nodes=nodes,
        node_rank=node_rank,
        cpu_count=os.cpu_count() or 1,
        source=f"file:{path}",
    )
    if gpu_memory_gib:
        base.gpus = [
            GPU(index=i, name=gpu_name, memory_mib=int(gpu_memory_gib * 1024), compute_capability="8.0")
            for i in range(matrix.gpu_count)
        ]
    return with_matrix(base, text)


def run_topo_matrix() -> str | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        done = subprocess.run([exe, "topo", "-m"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def probe(env: dict[str, str] | None = None, query_output: str | None = None, nvml=None) -> Topology:
    """Describe this machine (or one whose ``nvidia-smi`` output or NVML is given).

    NVML (nvidia-ml-py) is read first: names, memory, compute capability and NVLink state per
    pair; without it, ``nvidia-smi``'s query and ``topo -m`` matrix. ``CUDA_VISIBLE_DEVICES``
    narrows either to the GPUs this process will see, in its order.

    Args:
        env: environment to read (default: ``os.environ``).
        query_output: recorded ``nvidia-smi`` query output; default runs it (when NVML is absent).
        nvml: an initialised NVML module (recorded, in tests); default loads ``pynvml`` if installed.
    """
    env = dict(os.environ if env is None else env)
    nodes, node_rank = node_layout(env)
    cpus = usable_cores(env)
    if query_output is None:
        from ladle.machine import nvml as nvml_probe

        nvml = nvml if nvml is not None else nvml_probe.load()
        if nvml is not None:
            found, links = nvml_probe.read(nvml)
            if found:
                return nvml_topology(found, links, env, nodes, node_rank, cpus, query_output is None)
    text = query_output if query_output is not None else run_nvidia_smi()
    gpus = visible(parse_gpu_query(text), env) if text else []
    if not gpus:
        warning = "no CUDA GPU found: this is a CPU host; training runs as CPU processes on gloo"
        return Topology(
            gpu_count=0,
            cuda_available=False,
            interconnect="none",
            nodes=nodes,
            node_rank=node_rank,
            cpu_count=cpus,
            source="none",
            warnings=[warning],
        )
    topo = Topology(
        gpu_count=len(gpus),
        gpus=gpus,
        cuda_available=True,
        interconnect="unknown" if len(gpus) > 1 else "none",
        nodes=nodes,
        node_rank=node_rank,
        cpu_count=cpus,
        source="nvidia-smi",
    )
    matrix = run_topo_matrix() if query_output is None and len(gpus) > 1 else None
    if matrix:
        try:
            return with_matrix(topo, matrix)
        except LadleError as err:
            topo.warnings.append(f"interconnect unknown: {err}")
    return topo


def nvml_topology(
    found: list[dict], links: list[list[str]], env: dict[str, str], nodes: int, node_rank: int, cpus: int, live: bool
) -> Topology:
    """A Topology from NVML's GPUs and link matrix, narrowed to the visible GPUs; NUMA and NICs, which
    NVML does not relate to GPUs, come from ``nvidia-smi topo -m`` when it runs."""
    from ladle.machine.topo_matrix import facts

    gpus = visible([GPU(**g) for g in found], env)
    keep = [g.index for g in gpus]
    sub = [[links[i][j] for j in keep] for i in keep]
    matrix = facts(sub, None, [])
    topo = Topology(
        gpu_count=len(gpus),
        gpus=[g.model_copy(update={"index": n}) for n, g in enumerate(gpus)],
        cuda_available=True,
        nodes=nodes,
        node_rank=node_rank,
        cpu_count=cpus,
        source="nvml",
        **{k: v for k, v in matrix.model_dump().items() if k != "gpu_count"},
    )
    text = run_topo_matrix() if live and len(found) > 1 else None
    if text:
        from ladle.machine.topo_matrix import parse

        try:
            extra = parse(text)
            topo.nics, topo.numa_nodes = extra.nics, extra.numa_nodes
        except LadleError as err:
            topo.warnings.append(f"NUMA and NICs unknown: {err}")
    return topo
