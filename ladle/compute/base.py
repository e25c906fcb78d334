"""The interface every compute target implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from ladle.config import LadleConfig
    from ladle.machine.topology import Topology
    from ladle.train.run import ProgressFn
    from ladle.train.spec import TrainResult, TrainSpec


class ComputeTarget(ABC):
    """Runs a planned training on some machines and reports its result.

    ``run`` has the contract of the local launch: progress events to ``on_progress``, other output lines to
    ``on_line``, what was started to ``on_command``, checkpoints and ``train_result.json`` in the run folder of
    the artifact store (so a retry resumes exactly), ``TrainingFailed`` when training fails, and whatever it
    started is stopped when the caller is interrupted (a Prefect cancel raises in the flow-run process).
    """

    name: ClassVar[str]
    summary: ClassVar[str]
    """One line for the docs and ``compute.target``'s schema."""

    def __init__(self, cfg: LadleConfig) -> None:
        self.cfg = cfg

    @property
    def opts(self):
        """This target's options section (``compute.slurm``, ``compute.kubernetes``); None for ``local``."""
        return getattr(self.cfg.compute, self.name, None)

    def gpus_per_node(self, plan=None) -> int:
        """GPUs to ask the scheduler for per node: the configured count, else the plan's ranks per node on a
        GPU run, else (before planning) an integer ``parallelism.gpus``; 0 for a CPU run."""
        configured = getattr(self.opts, "gpus_per_node", None)
        if configured is not None:
            return configured
        if plan is not None:
            return plan.processes_per_machine if plan.device == "cuda" else 0
        gpus = self.cfg.parallelism.gpus
        return gpus if isinstance(gpus, int) else 0

    def launch_text(self, plan, spec: str) -> str:
        """What ``ladle plan`` shows as the launch: the command (or batch script) that runs ``spec``."""
        return plan.launch_command([spec])

    def probe(self) -> Topology:
        """The topology of one node training will run on: this machine's, unless the target reaches its nodes."""
        from ladle.machine.topology import probe

        return probe()

    @abstractmethod
    def run(
        self,
        spec: TrainSpec,
        on_progress: ProgressFn | None = None,
        on_line: Callable[[str], None] | None = None,
        on_command: Callable[[str], None] | None = None,
    ) -> TrainResult:
        """Train ``spec`` to completion."""
