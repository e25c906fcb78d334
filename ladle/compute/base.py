"""The interface every compute target implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from ladle.config import LadleConfig
    from ladle.topology import Topology
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

    def __init__(self, cfg: LadleConfig) -> None:
        self.cfg = cfg

    def launch_text(self, plan, spec: str) -> str:
        """What ``ladle plan`` shows as the launch: the command (or batch script) that runs ``spec``."""
        return plan.launch_command([spec])

    @abstractmethod
    def probe(self) -> Topology:
        """The topology of one node training will run on."""

    @abstractmethod
    def run(
        self,
        spec: TrainSpec,
        on_progress: ProgressFn | None = None,
        on_line: Callable[[str], None] | None = None,
        on_command: Callable[[str], None] | None = None,
    ) -> TrainResult:
        """Train ``spec`` to completion."""
