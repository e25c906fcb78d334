"""``compute.target: local``: this machine (other machines join by hand with ``ladle launch``)."""

from __future__ import annotations

from ladle.compute.base import ComputeTarget


class LocalTarget(ComputeTarget):
    name = "local"
    summary = "this machine (plus machines that join by hand with `ladle launch` when parallelism.nodes > 1)"

    def run(self, spec, on_progress=None, on_line=None, on_command=None):
        from ladle.train.run import launch

        return launch(spec, on_progress=on_progress, on_line=on_line, on_command=on_command)
