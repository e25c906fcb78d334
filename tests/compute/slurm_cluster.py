"""A real two-node Slurm cluster on 127.0.0.1, started and stopped by the tests.

Debian's slurm-wlm daemons: munged (its own socket and key), slurmctld, and two slurmd, one per node name
(``n1``, ``n2``), each on its own port with its own spool folder (Slurm's multiple-slurmd setup: ``-N`` names
the node a daemon serves). Both nodes are this machine, so a two-node job really runs two ``srun`` tasks on
two Slurm nodes with node ids 0 and 1 and a rendezvous between them, on 2 cores. A requeued job waits
``cred_expire`` before it starts again: 5 s here, Slurm's default 120 s elsewhere.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

from ladle.platform.processes import free_port, stop_process

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel", "sinfo", "squeue")
NODES = ("n1", "n2")


def missing() -> list[str]:
    """Slurm and munge programs not installed here (`make slurm` installs them)."""
    search = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    return [name for name in DAEMONS if shutil.which(name, path=search) is None]


def config(root: Path, ctld_port: int, node_ports: dict[str, int]) -> str:
    nodes = "\n".join(
        f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={p} CPUs=2 State=UNKNOWN"
        for n, p in node_ports.items()
    )
    return f"""ClusterName=ladle-test
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={next(iter(node_ports.values()))}
AuthType=auth/munge
AuthInfo=socket={root}/munge/munge.sock,cred_expire=5
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool-%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=600
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


class LocalSlurm:
    """Start with ``start()`` (bounded), stop with ``stop()``; ``env`` points Slurm's clients at it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.conf = root / "slurm.conf"
        self.procs: list[subprocess.Popen] = []
        self.env = {**os.environ, "SLURM_CONF": str(self.conf), "PATH": os.environ["PATH"] + ":/usr/sbin:/sbin"}

    def spawn(self, *argv: str) -> None:
        log = open(self.root / f"{Path(argv[0]).name}-{len(self.procs)}.out", "wb")  # noqa: SIM115 - the daemon's
        self.procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env))

    def start(self, timeout_s: float = 60.0) -> LocalSlurm:
        munge = self.root / "munge"
        for folder in (munge, self.root / "state", *(self.root / f"spool-{n}" for n in NODES)):
            folder.mkdir(parents=True, exist_ok=True)
        munge.chmod(0o700)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        ports = {n: free_port() for n in NODES}
        self.conf.write_text(config(self.root, free_port(), ports), encoding="utf-8")
        self.spawn(
            "munged",
            "--foreground",
            "--force",
            f"--socket={munge}/munge.sock",
            f"--key-file={key}",
            f"--pid-file={munge}/munged.pid",
            f"--log-file={munge}/munged.log",
            f"--seed-file={munge}/seed",
        )
        self.wait(lambda: (munge / "munge.sock").exists(), timeout_s, "munged did not create its socket")
        self.spawn("slurmctld", "-D", "-i", "-f", str(self.conf))
        for node in NODES:
            self.spawn("slurmd", "-D", "-N", node, "-f", str(self.conf))
        self.wait(self.idle, timeout_s, "the nodes did not come up idle")
        return self

    def idle(self) -> bool:
        done = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, env=self.env, check=False
        )
        states = dict(line.split() for line in done.stdout.splitlines() if line.strip())
        return all(states.get(n) == "idle" for n in NODES)

    def wait(self, ready, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            dead = [p.args[0] for p in self.procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                self.stop()
                logs = "\n".join(f.read_text(errors="replace")[-1500:] for f in self.root.glob("*.log"))
                raise RuntimeError(f"local Slurm: {what} in {timeout_s:.0f} s (exited: {dead}).\n{logs}")
            time.sleep(0.2)

    def scontrol_job(self, job_id: str) -> dict[str, str]:
        from ladle.compute.slurm import parse_fields

        out = subprocess.run(
            ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, env=self.env, check=False
        )
        return parse_fields(out.stdout)

    def stop(self) -> None:
        subprocess.run(["scancel", "--full", "--user=root"], env=self.env, capture_output=True, check=False)
        for proc in reversed(self.procs):
            stop_process(proc, grace_s=10)
        self.procs.clear()
