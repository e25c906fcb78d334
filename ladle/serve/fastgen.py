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
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from ladle.errors import LadleError
from ladle.machine import cuda_arch
from ladle.platform.processes import free_port, free_run, port_free, running, stop_all

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
    vocab = config.get("vocab_size")
    if isinstance(vocab, int) and vocab % 8:
        # FastGen's unembedding runs a CUDA bias kernel over the vocabulary whose channels must be a multiple of 8
        # (deepspeed/inference/v2/kernels/core_ops/bias_activations); the engine dies in its rank otherwise.
        problems.append(
            f"serve.backend = mii: FastGen's unembedding needs vocab_size divisible by 8 and this model's is {vocab}. "
            f"Resize the embeddings to {-(-vocab // 64) * 64} (model.resize_token_embeddings(n, "
            "pad_to_multiple_of=64)) before training, or use serve.backend=transformers."
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


def start_within(start: Callable[[], T], timeout_s: float, what: str) -> tuple[T, list]:
    """``start()`` under a deadline; returns its value and the processes it left running (``psutil.Process``).

    Only what appeared during the start is counted, and killed when the start fails or runs out of time:
    processes this one had already started (another server, a Prefect API, a test harness) are left alone.
    MII's start raises after its servers are up (or one of them died), and waits for ever for a server that
    never listens: either way every process it spawned is stopped before the error is raised.

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

    seen: dict[int, psutil.Process] = {}

    def spawned() -> list:
        """Every process the start has spawned so far, remembered as it is seen: one whose parent died (a
        launcher killed) leaves this process's tree, but not this list."""
        for child in psutil.Process().children(recursive=True):
            if child.pid not in before:
                seen.setdefault(child.pid, child)
        return list(seen.values())

    thread = threading.Thread(target=run, name="ladle-start", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while thread.is_alive() and time.monotonic() < deadline:
        spawned()
        thread.join(min(0.25, max(deadline - time.monotonic(), 0)))
    if thread.is_alive():
        killed = stop_all(spawned(), grace_s=0)
        raise LadleError(
            f"serve.start_timeout_s = {timeout_s:g}: {what} did not start in time; its {killed} process(es) "
            "were killed. Its log above says why (often: the GPUs are busy, or the model does not fit)."
        )
    if "error" in box:
        killed = stop_all(spawned(), grace_s=0)
        raise LadleError(
            f"serve.backend: {what} failed to start: {type(box['error']).__name__}: {box['error']} "
            f"({killed} process(es) it had started were killed)."
        )
    return box["value"], [p for p in spawned() if running(p)]


@dataclass(frozen=True)
class Ports:
    """One MII deployment's own ports, so that a champion swap's new deployment never meets the old one's:
    MII's load balancer takes ``port_number``, each tensor-parallel rank of each replica the ports after it,
    replica ``i``'s process group ``torch_dist_port + 100 i`` and its ZeroMQ ``zmq_port_number + i``."""

    port_number: int
    torch_dist_port: int
    zmq_port_number: int

    @classmethod
    def pick(cls, tensor_parallel: int, replica_num: int) -> Ports:
        grpc = free_run(1 + tensor_parallel * replica_num)
        dist = next(p for p in iter(free_port, None) if all(port_free(p + 100 * i) for i in range(replica_num)))
        return cls(grpc, dist, free_run(replica_num))


def prebuild_ops(timeout_s: float) -> float:
    """Build (or load from ``TORCH_EXTENSIONS_DIR``) FastGen's CUDA ops in a child process, before MII starts;
    returns the seconds it took. A first start builds them just in time (93 s measured on an H100); doing it
    here times it, names it in the log, and keeps CUDA out of the front process.

    Raises:
        LadleError: the build failed or ran past ``timeout_s``, with the tail of its output.
    """
    import subprocess
    import sys

    code = (
        "from deepspeed.ops.op_builder import InferenceCoreBuilder, RaggedOpsBuilder, RaggedUtilsBuilder\n"
        "for builder in (InferenceCoreBuilder, RaggedOpsBuilder, RaggedUtilsBuilder): builder().load()\n"
    )
    env, _ = cuda_arch.fixed_env()
    began = time.monotonic()
    try:
        done = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired:
        raise LadleError(
            f"serve.start_timeout_s = {timeout_s:g}: building DeepSpeed's FastGen ops did not finish in time."
        ) from None
    if done.returncode != 0:
        raise LadleError(
            "serve.backend = mii: building DeepSpeed's FastGen ops failed (nvcc and the CUDA headers must match "
            f"torch's CUDA):\n{(done.stdout + done.stderr)[-2000:]}"
        )
    return time.monotonic() - began
