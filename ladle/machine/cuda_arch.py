"""``TORCH_CUDA_ARCH_LIST`` as DeepSpeed's just-in-time op builder can read it.

CUDA images for Hopper and Blackwell list architecture-specific targets such as ``9.0a`` or ``10.0f``.
PyTorch's extension builder accepts them; DeepSpeed 0.19's ``compute_capability_args`` sorts the list with
``int()`` over each part and fails on the first one (``ValueError: invalid literal for int() with base 10:
'0a'``), so its ops (FastGen's for MII, fused optimizers for training) never build. Dropping the suffix
keeps the same compute capability: ``9.0`` code runs on an H100, without the ``a``-only instructions that
DeepSpeed's kernels do not use.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

VARIABLE = "TORCH_CUDA_ARCH_LIST"
_ENTRY = re.compile(r"^(\d+)\.(\d+)([a-z]+)(\+PTX)?$")


def parseable(value: str) -> str:
    """``value`` with every ``X.Ya`` / ``X.Yf`` entry written ``X.Y`` (``+PTX`` kept); separators normalised
    to ``;``. Entries that are already numbers, or names such as ``Hopper``, are left as they are."""
    entries = [entry for entry in re.split(r"[;\s]+", value.strip()) if entry]
    return ";".join(_ENTRY.sub(r"\1.\2\4", entry) for entry in entries)


def fixed_env(env: Mapping[str, str] | None = None) -> tuple[dict[str, str], str | None]:
    """A copy of ``env`` (default: this process's) whose arch list DeepSpeed can parse, and the reason when it
    had to change (None: unchanged or unset)."""
    env = dict(os.environ if env is None else env)
    value = env.get(VARIABLE)
    if not value or not any(_ENTRY.match(entry) for entry in re.split(r"[;\s]+", value.strip())):
        return env, None
    env[VARIABLE] = parseable(value)
    return env, (
        f"{VARIABLE} = {value}: DeepSpeed's op builder cannot parse architecture suffixes; its processes get "
        f"{env[VARIABLE]} (the same compute capabilities)"
    )
