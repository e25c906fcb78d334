"""What planning reads from a config's inputs before anything runs: the base's ``config.json``, and
whether the base and the data hold anything at all."""

from __future__ import annotations

from pathlib import Path

from ladle.assets import ASSET_VERSION, BUILTIN_SCHEME, MODEL_CONFIGS, ladle_home, resolve_base, resolve_builtin
from ladle.assets.gguf import cached, is_gguf
from ladle.config import LadleConfig
from ladle.platform import storage


def check_inputs(cfg: LadleConfig) -> dict:
    """The base holds a model and every data source holds a record (cheap reads only); returns the
    base's ``config.json`` for sizing.

    Shared by the CLI (before Prefect starts) and the validate task (for deployments).

    Raises:
        LadleError: naming the field, the value and the fix.
    """
    from ladle.data.prepare import check_not_empty
    from ladle.sizing.params import read_config

    base = resolve_base(cfg.base, cfg.training.dtype)
    check_not_empty(cfg.data.path)
    if cfg.data.eval_path:
        check_not_empty(cfg.data.eval_path, "data.eval_path")
    return read_config(base)


def local_model_config(cfg: LadleConfig, override: str | None = None) -> dict | None:
    """``--model-config``, else the base's config.json when it is already on this machine (nothing is created
    or downloaded: planning stays fast); None when neither is at hand."""
    from ladle.sizing.params import read_config

    if override:
        return read_config(override)
    base = cfg.base
    if base == BUILTIN_SCHEME + "smollm2-135m-instruct" or is_gguf(base):
        folder = cached(storage.normalise(resolve_builtin(base, "base")), cfg.training.dtype)
        return read_config(folder) if folder else None
    if base.startswith(BUILTIN_SCHEME + MODEL_CONFIGS):
        base = resolve_builtin(base, "base")
    elif base.startswith(BUILTIN_SCHEME):
        base = str(ladle_home() / "assets" / f"{base.removeprefix(BUILTIN_SCHEME)}-{ASSET_VERSION}")
    return read_config(base) if Path(base, "config.json").is_file() else None
