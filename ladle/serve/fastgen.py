"""What DeepSpeed-MII needs before it starts: a model architecture FastGen implements, and a watchdog.

FastGen (DeepSpeed's inference v2, which MII serves with) builds an engine only for the ``model_type``
values its ``build_hf_engine`` knows. The installed DeepSpeed does not export that list, so it is read
from the source of ``deepspeed/inference/v2/engine_factory.py`` (without importing it, which would import
torch and CUDA code): the list is always the installed version's. MII itself can wait forever for its
servers to come up, so ``start_within`` runs the start in a thread and, past the deadline, kills every
process it spawned and says why.
"""

from __future__ import annotations

import importlib.util
import json
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from ladle.errors import LadleError

T = TypeVar("T")


def fastgen_model_types() -> list[str]:
    """The ``model_type`` values the installed DeepSpeed's FastGen builds engines for (empty: not found)."""
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or not spec.submodule_search_locations:
        return []
    factory = Path(list(spec.submodule_search_locations)[0], "inference", "v2", "engine_factory.py")
    if not factory.is_file():
        return []
    return sorted(set(re.findall(r'model_type == "([^"]+)"', factory.read_text(encoding="utf-8"))))


def check_architecture(model_dir: str) -> str:
    """The model's ``model_type``, when FastGen can serve it.

    Raises:
        LadleError: FastGen does not implement it (or DeepSpeed's list is not found), naming the alternative.
    """
    config = json.loads(Path(model_dir, "config.json").read_text(encoding="utf-8"))
    kind = config.get("model_type", "?")
    known = fastgen_model_types()
    if not known:
        raise LadleError(
            "serve.backend = mii: the installed DeepSpeed has no FastGen engine factory "
            "(deepspeed/inference/v2/engine_factory.py). Install deepspeed>=0.12, or use serve.backend=transformers."
        )
    if kind not in known:
        raise LadleError(
            f"serve.backend = mii: DeepSpeed-MII (FastGen) cannot serve model_type {kind!r}; the installed "
            f"DeepSpeed implements {', '.join(known)}. Use serve.backend=transformers."
        )
    return kind


def start_within(start: Callable[[], T], timeout_s: float, what: str) -> T:
    """``start()``, or after ``timeout_s`` every process the start spawned killed and a clear error.

    Only what appeared during the start is killed: processes this one had already started (another server,
    a Prefect API, a test harness) are left alone.

    Raises:
        LadleError: the start raised, or did not finish in time.
    """
    import psutil

    box: dict = {}
    before = {child.pid for child in psutil.Process().children(recursive=True)}

    def run() -> None:
        try:
            box["value"] = start()
        except BaseException as exc:  # reported below, in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=run, name="ladle-start", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        children = [c for c in psutil.Process().children(recursive=True) if c.pid not in before]
        for child in children:
            child.kill()
        raise LadleError(
            f"serve.start_timeout_s = {timeout_s:g}: {what} did not start in time; its {len(children)} process(es) "
            "were killed. Its log above says why (often: the GPUs are busy, or the model does not fit)."
        )
    if "error" in box:
        raise LadleError(f"serve.backend: {what} failed to start: {type(box['error']).__name__}: {box['error']}")
    return box["value"]
