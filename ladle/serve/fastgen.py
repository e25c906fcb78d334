"""What DeepSpeed-MII needs before it starts: a model FastGen can run, and a watchdog.

FastGen (DeepSpeed's inference v2, which MII serves with) builds an engine only for the ``model_type``
values its ``build_hf_engine`` knows, only from fp16/bf16 weights, and its rotary and KV-copy kernels only
for some head sizes. The installed DeepSpeed exports neither list, so both are read from its source
(``inference/v2/engine_factory.py`` and the ``blocked_kv_rotary`` kernel) without importing it, which would
import torch and CUDA code: the lists are always the installed version's. The planner runs these checks on
the base's ``config.json`` before anything trains, and the server again on the merged folder. MII itself can wait forever for its
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


FASTGEN_DTYPES = ("bfloat16", "float16")
"""Weight dtypes FastGen builds engines for (``Only fp16 and bf16 are supported``)."""


def deepspeed_source(*parts: str) -> str | None:
    """The text of a file of the installed DeepSpeed (None: not installed, or no such file)."""
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0], *parts)
    return path.read_text(encoding="utf-8") if path.is_file() else None


def fastgen_model_types() -> list[str]:
    """The ``model_type`` values the installed DeepSpeed's FastGen builds engines for (empty: not found)."""
    text = deepspeed_source("inference", "v2", "engine_factory.py") or ""
    return sorted(set(re.findall(r'model_type == "([^"]+)"', text)))


def fastgen_head_sizes() -> list[int]:
    """The attention head sizes the installed FastGen's rotary/KV kernels take (empty: not found)."""
    kernel = ("inference", "v2", "kernels", "ragged_ops", "linear_blocked_kv_rotary", "blocked_kv_rotary.py")
    found = re.search(r"supported_head_sizes = \[([\d, ]+)\]", deepspeed_source(*kernel) or "")
    return [int(n) for n in found.group(1).split(",")] if found else []


def head_size(config: dict) -> int | None:
    """Attention head size of a Hugging Face ``config.json`` (its ``head_dim``, or hidden size over heads)."""
    if config.get("head_dim"):
        return int(config["head_dim"])
    hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
    return hidden // heads if hidden and heads else None


def fastgen_problems(config: dict, dtype: str) -> list[str]:
    """Why FastGen cannot serve a model with ``config`` (its ``config.json``) in ``dtype``; empty when it can.
    Each problem names the field and the fix."""
    known, sizes = fastgen_model_types(), fastgen_head_sizes()
    if not known:
        return [
            "serve.backend = mii: the installed DeepSpeed has no FastGen engine factory "
            "(deepspeed/inference/v2/engine_factory.py). Install deepspeed>=0.12, or use serve.backend=transformers."
        ]
    problems = []
    kind = config.get("model_type", "?")
    if kind not in known:
        problems.append(
            f"serve.backend = mii: DeepSpeed-MII (FastGen) cannot serve model_type {kind!r}; the installed "
            f"DeepSpeed implements {', '.join(known)}. Use serve.backend=transformers."
        )
    if dtype not in FASTGEN_DTYPES:
        problems.append(
            f"serve.backend = mii: FastGen serves fp16/bf16 weights only and the merged model would be {dtype}. "
            "Set training.dtype=bfloat16 (or float16), or use serve.backend=transformers."
        )
    size = head_size(config)
    if sizes and size not in sizes:
        problems.append(
            f"serve.backend = mii: FastGen's kernels take attention head sizes {', '.join(map(str, sizes))} and "
            f"this model's is {size} (head_dim, or hidden_size / num_attention_heads). "
            "Use serve.backend=transformers."
        )
    return problems


def check_architecture(model_dir: str) -> str:
    """The model's ``model_type``, when FastGen can serve the folder as saved (architecture, dtype, heads).

    Raises:
        LadleError: every reason FastGen cannot, naming the alternative.
    """
    config = json.loads(Path(model_dir, "config.json").read_text(encoding="utf-8"))
    dtype = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    problems = fastgen_problems(config, dtype)
    if problems:
        raise LadleError(" ".join(problems))
    return config.get("model_type", "?")


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
