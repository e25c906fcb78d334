"""What each compute target needs before anything starts, for the planner (which must not import the targets
themselves: they run training specs, and a spec holds a plan)."""

from __future__ import annotations

import shutil

from ladle.platform import storage

SLURM_CLIENT = ("sbatch", "srun", "scontrol", "scancel")


def problems(cfg, live: bool = True) -> list[str]:
    """What stops ``cfg.compute.target`` from running ``cfg``, each naming the field and the fix.

    ``live``: this host is the one that submits (False when planning for a recorded machine).
    """
    target = cfg.compute.target
    if target == "slurm":
        return slurm_problems(cfg, live)
    if target == "kubernetes" and storage.is_local(cfg.output):
        return [
            f"output = {cfg.output!r}: pods cannot read or write this machine's folders. Set output to an "
            "object store the cluster reaches (s3://bucket/prefix) for compute.target=kubernetes."
        ]
    return []


def slurm_problems(cfg, live: bool) -> list[str]:
    opts, out = cfg.compute.slurm, []
    missing = [c for c in SLURM_CLIENT if shutil.which(c) is None] if live else []
    if missing:
        out.append(
            f"compute.target = 'slurm': {', '.join(missing)} not found on PATH. Run the pipeline where the "
            "Slurm client is installed (a login node), or set compute.target=local."
        )
    if opts.log_dir is not None and not storage.is_local(opts.log_dir):
        out.append(
            f"compute.slurm.log_dir = {opts.log_dir!r}: Slurm writes the job's output to a file, so this "
            "must be a folder on a file system the nodes and this machine share, not a URL."
        )
    elif opts.log_dir is None and not storage.is_local(cfg.output):
        out.append(
            f"compute.slurm.log_dir = null: output {cfg.output!r} is not a local folder, so the job's "
            "output has no shared folder to go to. Set compute.slurm.log_dir to one the nodes share."
        )
    return out


def rendezvous(cfg) -> str:
    """Where the nodes meet, for the plan's reasons."""
    target, p = cfg.compute.target, cfg.parallelism
    if target == "slurm":
        return f"the allocation's first node (its NodeAddr), port {p.main_port or '15000 + job id mod 10000'}"
    if target == "kubernetes":
        return f"the master pod's service, port {cfg.compute.kubernetes.port}"
    return f"{p.main_address}:{p.main_port}"
