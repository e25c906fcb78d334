"""Start-up of ladle's processes: heavy imports with Python's cyclic collector paused, then frozen.

Importing torch, transformers, peft and accelerate builds ~700k objects that live as long as the process. With
the collector on, every full collection the imports trigger scans all of them again: measured on a 2-core
host, 3.5 s of CPU for those imports with it on, 2.6 s with it paused. Pausing it while they load and then
freezing what they built (``gc.freeze``: moved out of every later collection, never freed) is the recipe
Python's documentation gives for servers that fork after loading, and it pays in any process that imports
once and lives on: the fork launcher, model servers, the temporary Prefect API server.

    python -m ladle.platform.startup MODULE [MODULE ...] -- -m TARGET [ARGS ...]

imports the MODULEs that way, then runs ``python -m TARGET ARGS...`` in the same process (how ladle starts
third-party servers it does not own the entry point of: uvicorn under Prefect's app factory).

Processes whose imports happen as they go (the ``ladle`` command, whose handlers import what they use; a flow
run started by a Prefect worker, whose stages import theirs) raise the collector's thresholds instead
(``raise_thresholds``): a young-generation collection every 50,000 net allocations instead of 700, and the
older generations' collections 20 and 100 young ones apart. Measured on a 2-core host (``bench/startup.py``,
CPU, medians): ``ladle model list`` 2.82 s before, 2.42 s after; ``ladle data prepare`` 4.91 s, 4.57 s; a flow
run's stage libraries 7.16 s, 6.38 s. Cyclic garbage is still collected, later; what waits is at most that
many objects.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import runpy
import sys
from collections.abc import Iterator

THRESHOLDS = (50_000, 20, 100)
"""``gc.set_threshold`` in ladle's processes that import as they go (Python's default: 700, 10, 10)."""


@contextlib.contextmanager
def quiet_collector() -> Iterator[None]:
    """No cyclic collection inside the block; on leaving it, what exists is frozen and the collector is back
    on as it was. Only for code that builds long-lived objects (imports, a model's load): cyclic garbage made
    inside is kept until the process ends."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_enabled:
            gc.enable()


def raise_thresholds() -> None:
    """The collector's thresholds set to ``THRESHOLDS`` for this process: fewer collections while the libraries
    a command or a stage imports build their objects."""
    gc.set_threshold(*THRESHOLDS)


def flow_run_process() -> None:
    """At the start of a deployment's flow: ``raise_thresholds`` in the process a Prefect worker started for
    this flow run (``PREFECT__FLOW_RUN_ID`` set: the process is the run's own). A flow called in a process of
    someone else's (a notebook, a test, ``ladle run``, which raises them itself) leaves its collector alone."""
    if os.environ.get("PREFECT__FLOW_RUN_ID"):
        raise_thresholds()


USAGE = "usage: python -m ladle.platform.startup MODULE [MODULE ...] -- -m TARGET [ARGS ...]"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print(USAGE, file=sys.stderr)
        return 2
    cut = argv.index("--")
    preload, rest = argv[:cut], argv[cut + 1 :]
    if len(rest) < 2 or rest[0] != "-m":
        print(USAGE, file=sys.stderr)
        return 2
    with quiet_collector():
        for module in preload:
            importlib.import_module(module)
    sys.argv = [rest[1], *rest[2:]]
    runpy.run_module(rest[1], run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
