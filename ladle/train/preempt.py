"""A checkpoint when the cluster says stop.

Clusters preempt: Slurm sends SIGTERM before it kills a preempted job (``GraceTime``) and, with ``--signal``,
SIGUSR1 before its time limit; Kubernetes sends SIGTERM and waits ``terminationGracePeriodSeconds``. A run that
dies there loses everything since its last periodic checkpoint. So each rank catches SIGTERM and SIGUSR1 and
records it (``Preemption``); after every step the ranks agree whether any of them was told (one all-reduce of one
integer), and if so every rank takes part in a checkpoint of the step just finished and the run exits with
``PREEMPTED`` (75, ``EX_TEMPFAIL``: "try again later"), which the Slurm backend's batch script answers with
``scontrol requeue`` and the local backend reports as a preemption to resume from. The requeued run resumes from
that checkpoint: no step is lost.

The step in progress when the signal arrives finishes first (its gradients are applied, or the checkpoint would
not be the state of a step boundary); ``training.preempt_grace_s`` is the time the run asks for between the
signal and the end (Slurm's ``--signal=USR1@grace``, the launchers' wait before SIGKILL). A run killed outright
(SIGKILL, a node lost) resumes from its last periodic checkpoint, as before.
"""

from __future__ import annotations

import signal
import time

PREEMPTED = 75
"""The exit code of a run that checkpointed because it was told to stop: requeue it."""

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

STOPPED = "checkpointed when told to stop; exiting 75 to be requeued"
"""What each node's first rank prints once the ranks checkpointed and stop: the node's launcher process reads
it to tell this exit from a crash (torchrun reports the ranks' 75 as a failure of its own), on every node, not
only where rank 0 runs."""


def stopped_line(rank: int, stop: Exception) -> str:
    return f"ladle: rank {rank}: {stop}; {STOPPED}"


class Preempted(Exception):
    """The ranks agreed to stop after ``step``, whose checkpoint is written."""

    def __init__(self, step: int, signum: int):
        super().__init__(f"preempted after step {step} ({signal.Signals(signum).name}); its checkpoint is written")
        self.step, self.signum = step, signum


class Preemption:
    """Whether this rank was told to stop (by ``SIGNALS``), and when."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.at: float | None = None

    def install(self) -> None:
        for sig in SIGNALS:
            signal.signal(sig, self.told)

    def told(self, signum, _frame) -> None:
        if self.signum is None:
            self.signum, self.at = signum, time.monotonic()

    def agreed(self, accelerator) -> int | None:
        """The signal any rank was told (every rank gets the same answer: a collective), or None."""
        import torch

        mine = self.signum or 0
        if accelerator.num_processes == 1:
            return mine or None
        flag = torch.tensor([mine], dtype=torch.long, device=accelerator.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return int(flag.item()) or None


PREEMPTION = Preemption()
