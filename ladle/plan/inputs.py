"""A run's inputs, resolved once: the base as a local folder and its ``config.json``, whether the data holds
anything, the data's and the run's fingerprints, the output store and the tracking server (``RunInputs``); and
what planning alone reads (``check_inputs``, ``local_model_config``)."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from ladle.assets import ASSET_VERSION, BUILTIN_SCHEME, MODEL_CONFIGS, ladle_home, resolve_base, resolve_builtin
from ladle.assets.gguf import cached, is_gguf
from ladle.config import LadleConfig
from ladle.errors import LadleError
from ladle.platform import storage


class RunInputs(BaseModel):
    """What a run reads of the world outside its config, resolved once by the flow (``resolve_inputs``) and
    handed to each stage: no stage resolves the base, fingerprints the data or finds the tracking server again,
    so every stage sees the same base folder and the same data, even when the files change during the run."""

    model_config = ConfigDict(frozen=True)

    base_dir: str
    """The base model as a local folder (a GGUF file converted, a remote folder copied into the cache)."""
    base_config: dict
    """The base's ``config.json``: what the planner sizes."""
    output: str
    """``output``, normalised: the artifact store's URL."""
    data_fingerprint: str
    """The data's contents, tokenizer and options (``ladle.data.prepare.fingerprint``): names the prepared set."""
    objective: str = "sft"
    """``training.objective``: what the prepared rows hold (conversations, preference pairs, or prompts)."""
    reward_files: dict[str, str] = {}
    """grpo: the text of every reward named by a file, read once here: it travels with the run to every rank."""
    reward_columns: list[str] | None = None
    """grpo: the data columns the rewards read by name (None: every column, or not grpo)."""
    lineage: dict
    """What the run's fingerprint is made of (``ladle.lifecycle.lineage.parts``)."""
    fingerprint: str
    """The run's fingerprint: data, base and training settings (nightly runs skip when it is the champion's)."""
    tracking_uri: str
    """The MLflow server (credentials moved to the environment)."""
    artifact_location: str | None
    """Where a new experiment keeps its artifacts (None: the server decides)."""
    registered_model: str
    traffic: dict | None = None
    """``retrain.from_traffic``: what the run learns from the served model's traffic (``ladle.data.traffic``'s
    report: its window, counts and rows), kept in the run's lineage."""
    base_version: str | None = None
    """Where ``base`` names a registered model (``models:/NAME@ALIAS`` or ``models:/NAME/VERSION``): the version
    it resolved to, ``NAME vN``; the run records it (its lineage), and the base's weights are in the fingerprint."""
    """The registry's name for this config's model."""

    @property
    def base(self) -> Path:
        return Path(self.base_dir)

    @property
    def dataset_url(self) -> str:
        """Where the prepared dataset for these inputs is (or will be)."""
        return storage.join(self.output, "datasets", self.data_fingerprint)


def resolve_inputs(cfg: LadleConfig) -> RunInputs:
    """Resolve a run's inputs once (``RunInputs``).

    Raises:
        LadleError: the base holds no model or the data no record, naming the field, the value and the fix.
    """
    from ladle.data.prepare import fingerprint
    from ladle.lifecycle import lineage, tracking

    version = registered_version(cfg)  # once: the champion may move while the run goes on
    base_config = check_inputs(cfg, version)
    base = base_dir_of(cfg, version)
    data_fp = fingerprint(cfg.data, base, cfg.training.objective)
    parts = lineage.parts(cfg, data_fp, base)
    reward_files, columns = {}, None
    if cfg.training.objective == "grpo":
        from ladle import rewards

        reward_files = rewards.bundle(cfg.training.rl.rewards)
        columns = rewards.columns_needed(cfg.training.rl.rewards, reward_files)
        if cfg.training.rl.environment:
            reward_files.update(check_environment(cfg.training.rl.environment, base, cfg.data.seq_len))
    uri, artifacts = tracking.tracking_uri(cfg)
    return RunInputs(
        base_dir=str(base),
        base_config=base_config,
        output=storage.normalise(cfg.output),
        data_fingerprint=data_fp,
        objective=cfg.training.objective,
        reward_files=reward_files,
        reward_columns=columns,
        lineage=parts,
        fingerprint=lineage.fingerprint_of(parts),
        tracking_uri=uri,
        artifact_location=artifacts,
        registered_model=cfg.tracking.registered_model or cfg.name,
        base_version=f"{version.name} v{version.version}" if version else None,
    )


def check_environment(entry: str, base: Path, seq_len: int = 0) -> dict[str, str]:
    """The agent's environment loaded and its tools described, and the chat template able to carry tool calls,
    before anything trains; its file's text (to travel with the run's rewards). ``data.seq_len`` bounds a prompt
    as an episode renders it, its tools' descriptions included (the plan sizes the rollouts for it): a ``seq_len``
    that cannot hold even a one-word prompt with them is refused here.

    Raises:
        LadleError: the environment or the template cannot serve episodes, or the tools leave no room in
            ``data.seq_len`` (naming the field and the fix).
    """
    from transformers import AutoTokenizer

    from ladle.agents import environments
    from ladle.agents.episodes import render_ids
    from ladle.serve.tools import ToolError, format_of

    files = environments.bundle(entry)
    env = environments.load(entry, files)
    if env.steps or env.program:  # gym-style: text turns; a program's tools are checked when it sends them
        return files
    tokenizer = AutoTokenizer.from_pretrained(base)
    try:
        format_of(tokenizer.chat_template)
    except ToolError as exc:
        raise LadleError(
            f"training.rl.environment = {entry!r} with base's chat template: {exc}. Set chat_template to one "
            "that does (ladle://templates/chatml-tools for ChatML models such as SmolLM2)."
        ) from None
    word = [{"role": "user", "content": "Hi"}]
    least = len(render_ids(tokenizer, word, list(env.tools), prompt=True))
    if seq_len and least >= seq_len:
        tools = least - len(render_ids(tokenizer, word, [], prompt=True))
        raise LadleError(
            f"data.seq_len = {seq_len} cannot hold a prompt of training.rl.environment = {entry!r}: its tools' "
            f"descriptions take {tools} tokens of every prompt, and a one-word prompt with them {least}. "
            f"data.seq_len bounds a prompt with its tools: raise it to {least} plus your prompts' length."
        )
    return files


REGISTERED = "models:/"
REGISTERED_FORM = re.compile(r"models:/(?P<name>[^@/]+)(?:@(?P<alias>[A-Za-z0-9_-]+)|/(?P<version>\d+))")


def registered_version(cfg: LadleConfig):
    """The registry's version that ``base`` names (``models:/NAME@ALIAS``, ``models:/NAME/VERSION``), from the
    config's tracking server; None for any other base.

    Raises:
        LadleError: a malformed name, or no such model, alias or version (naming ``base`` and the fix).
    """
    if not cfg.base.startswith(REGISTERED):
        return None
    from ladle.lifecycle import promote, tracking
    from ladle.lifecycle.mlflow_client import absent, client, registry

    match = REGISTERED_FORM.fullmatch(cfg.base)
    if match is None:
        raise LadleError(
            f"base = {cfg.base!r}: a registered model is models:/NAME@ALIAS (e.g. models:/my-sft@champion) or "
            "models:/NAME/VERSION (e.g. models:/my-sft/3)"
        )
    uri, _ = tracking.tracking_uri(cfg)
    name, alias, number = match["name"], match["alias"], match["version"]
    with registry(uri, f"resolving base = {cfg.base}"):
        try:
            if alias:
                found = promote.as_version(client(uri).get_model_version_by_alias(name, alias))
            else:
                found = promote.as_version(client(uri).get_model_version(name, number))
        except Exception as exc:
            if not absent(exc):
                raise
            which = f"no version aliased {alias!r}" if alias else f"no version {number}"
            raise LadleError(
                f"base = {cfg.base!r}: the registry at the config's tracking server has {which} of model "
                f"{name!r} (or no such model). Train and promote one first (ladle run ITS_RECIPE), or point base "
                "at a model folder.",
                exit_code=1,
            ) from None
    return found


def base_dir_of(cfg: LadleConfig, version=None) -> Path:
    """The base as a local folder: a registered version's model folder (copied once from a remote store), else
    ``resolve_base``'s."""
    if version is None and cfg.base.startswith(REGISTERED):
        version = registered_version(cfg)
    from ladle.assets.templates import with_template

    if version is None:
        return with_template(resolve_base(cfg.base, cfg.training.dtype), cfg.chat_template)
    from ladle.lifecycle.copies import full_model_dir_of

    folder = full_model_dir_of(version)
    if not (folder / "config.json").is_file():
        raise LadleError(
            f"base = {cfg.base!r}: {version.name} v{version.version}'s files at {version.source} hold no model "
            "(no config.json). Point base at another version, or at a model folder.",
            exit_code=1,
        )
    return with_template(folder, cfg.chat_template)


def check_inputs(cfg: LadleConfig, version=None) -> dict:
    """The base holds a model and every data source holds a record (cheap reads only); returns the
    base's ``config.json`` for sizing.

    Shared by the CLI (before Prefect starts) and the validate task (for deployments).

    Raises:
        LadleError: naming the field, the value and the fix.
    """
    from ladle.data.prepare import check_not_empty
    from ladle.sizing.params import read_config

    base = base_dir_of(cfg, version)
    for index, source in enumerate(cfg.data.source_list()):
        check_not_empty(source.path, f"data.sources[{index}].path" if cfg.data.sources else "data.path")
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
    if base.startswith(REGISTERED):
        return read_config(base_dir_of(cfg))
    if base == BUILTIN_SCHEME + "smollm2-135m-instruct" or is_gguf(base):
        folder = cached(storage.normalise(resolve_builtin(base, "base")), cfg.training.dtype)
        return read_config(folder) if folder else None
    if base.startswith(BUILTIN_SCHEME + MODEL_CONFIGS):
        base = resolve_builtin(base, "base")
    elif base.startswith(BUILTIN_SCHEME):
        base = str(ladle_home() / "assets" / f"{base.removeprefix(BUILTIN_SCHEME)}-{ASSET_VERSION}")
    return read_config(base) if Path(base, "config.json").is_file() else None
