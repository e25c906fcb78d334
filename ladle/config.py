"""Config schema v1: one validated tree, loaded from YAML plus dotted overrides.

Every field carries a description (units, what 0/-1/auto mean); unknown keys
are rejected. Rules that need the machine (world size, CUDA) live in the
planner, which reports every problem at once.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ladle.errors import ConfigError, LadleError

SCHEMA_VERSION = 1
MAX_GPU_COUNT = 128


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class DataConfig(Section):
    path: str = Field(
        description="Training data: a local path or fsspec URL (s3://, memory://), globs allowed, of JSONL, "
        "JSON, Parquet or CSV files (by suffix; .gz etc. decompressed), or `ladle://demo-alpaca` for the "
        "bundled generated demo set."
    )
    format: Literal["auto", "alpaca", "sharegpt", "messages", "chatml", "text", "tokenized"] = Field(
        "auto",
        description="Record format. `alpaca`: instruction/input/output; `sharegpt`: conversations of "
        "{from, value}; `messages`/`chatml`: messages of {role, content}; `text`: a `text` field; "
        "`tokenized`: `input_ids` (and optional `labels`). `auto` detects it from the first record.",
    )
    eval_path: str | None = Field(
        None, description="Separate evaluation file (same format). null: split `eval_ratio` off the training data."
    )
    eval_ratio: float = Field(
        0.1, ge=0.0, lt=1.0, description="Fraction of rows held out for evaluation when `eval_path` is null."
    )
    seq_len: int = Field(256, ge=16, le=131072, description="Tokens per packed training row.")
    pack: bool = Field(True, description="Pack several examples into each `seq_len` row (first-fit-decreasing).")
    truncation: Literal["right", "drop"] = Field(
        "right",
        description="Examples longer than seq_len: `right` cuts the end (counted in the report), `drop` "
        "skips them (listed in the report, not counted as bad rows).",
    )
    dedup: bool = Field(False, description="Skip exact duplicate records (same conversation/text/ids).")
    train_on: Literal["response", "all"] = Field(
        "response", description="Which tokens carry a loss: only assistant responses, or all tokens."
    )
    seed: int = Field(0, description="Seed of the train/eval split shuffle.")
    max_bad_fraction: float = Field(
        0.01,
        ge=0.0,
        le=1.0,
        description="Largest fraction of unusable rows tolerated; they are skipped and reported by line. "
        "Above it the prepare stage fails with the report.",
    )


class LoraConfig(Section):
    enabled: bool = Field(True, description="Train LoRA adapters (true) or all weights (false).")
    r: int = Field(8, ge=1, le=1024, description="LoRA rank.")
    alpha: float = Field(16.0, gt=0, description="LoRA scaling numerator (scale = alpha / r).")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the LoRA input.")
    target_modules: list[str] | Literal["all-linear"] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        description="Module names (suffix match, as peft does) that receive adapters, or `all-linear`.",
    )

    modules_to_save: list[str] = Field(
        default_factory=list,
        description="Modules trained in full next to the adapters and saved with them (e.g. [lm_head, "
        "embed_tokens] when the base's head or embeddings must adapt).",
    )

    @field_validator("target_modules")
    @classmethod
    def _non_empty(cls, value: list[str] | str) -> list[str] | str:
        if isinstance(value, list) and not value:
            raise ValueError("must name at least one module, e.g. [q_proj, v_proj], or be 'all-linear'")
        return value


class QuantizationConfig(Section):
    mode: Literal["none", "nf4"] = Field(
        "none", description="`nf4` loads the base in 4-bit for QLoRA (needs CUDA and bitsandbytes)."
    )
    storage_dtype: Literal["auto", "uint8", "bfloat16", "float16", "float32"] = Field(
        "auto",
        description="bnb_4bit_quant_storage: the dtype packed 4-bit weights are stored in. auto: the "
        "training dtype when the strategy shards the base (FSDP2 and ZeRO-3 shard float tensors only), else uint8.",
    )


class TrainingConfig(Section):
    max_steps: int = Field(
        -1, ge=-1, description="Optimizer steps to run. -1: derive from `epochs` and the dataset size."
    )
    epochs: float = Field(1.0, gt=0, description="Passes over the training data when `max_steps` is -1.")
    lr: float = Field(2e-4, gt=0, description="Peak learning rate.")
    micro_batch_size: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        4,
        description="Packed rows per process per forward pass. auto: the largest power of two up to 64 whose "
        "per-rank memory fits (sized from the base's config.json) and that divides the global batch.",
    )
    global_batch_size: int = Field(
        0,
        ge=0,
        description="Packed rows per optimizer step across all processes. 0: micro_batch_size x world size "
        "(no gradient accumulation). Must be a multiple of micro_batch_size x world size.",
    )
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up steps.")
    scheduler: Literal["cosine", "linear", "constant"] = Field("cosine", description="Learning-rate schedule.")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    max_grad_norm: float = Field(1.0, ge=0.0, description="Gradient clipping norm. 0: no clipping.")
    seed: int = Field(42, description="Seed for initialisation, data order and dropout.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Training dtype. auto: float32 on CPU, bfloat16 on GPUs that support it."
    )
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward to save memory.")
    checkpoint_every: int = Field(
        0, ge=0, description="Write a resumable checkpoint every N optimizer steps. 0: only at the end."
    )
    eval_every: int = Field(0, ge=0, description="Evaluate every N steps. 0: only before and after training.")
    lora: LoraConfig = Field(default_factory=LoraConfig, description="LoRA adapter settings.")
    quantization: QuantizationConfig = Field(
        default_factory=QuantizationConfig, description="Base-model quantization (QLoRA)."
    )


GpuCount = Annotated[int, Field(ge=1, le=MAX_GPU_COUNT)]


class DDPOptions(Section):
    bucket_cap_mb: int = Field(25, ge=1, description="DDP gradient bucket size in MiB.")
    find_unused_parameters: bool = Field(False, description="Let DDP tolerate parameters without gradients.")


class FSDP2Options(Section):
    reshard_after_forward: bool = Field(
        True, description="Free each layer's gathered parameters after its forward (less memory, one more all-gather)."
    )
    cpu_offload: bool = Field(False, description="Keep parameters and optimizer state in CPU memory (CUDA runs only).")
    replicate: int = Field(
        1,
        ge=0,
        le=1024,
        description="HSDP: replica groups (data-parallel replicate degree); parameters are "
        "sharded within each group of world/replicate ranks and gradients all-reduced across groups. 1: plain "
        "FSDP (shard over all ranks). 0: one group per machine (shard inside the node, replicate across nodes).",
    )
    compile: bool = Field(
        False,
        description="use_fsdp2_compile: torch.compile each decoder block in place before sharding (CUDA, "
        "torch >= 2.2, accelerate >= 0.27). FSDP2 only; DeepSpeed with torch.compile is rejected.",
    )


ZERO_STRATEGIES = ("zero1", "zero2", "zero3", "zero++")
STRATEGY_ALIASES = {"zero_pp": "zero++", "zeropp": "zero++", "zero-pp": "zero++"}


class DeepSpeedOptions(Section):
    offload_optimizer: Literal["none", "cpu", "nvme"] = Field(
        "none", description="ZeRO-Offload of optimizer state (and its step) to CPU or NVMe. CUDA runs only."
    )
    offload_param: Literal["none", "cpu", "nvme"] = Field(
        "none", description="ZeRO-Infinity parameter offload to CPU or NVMe. Stage 3 (zero3, zero++) and CUDA only."
    )
    nvme_path: str | None = Field(None, description="Local NVMe folder for `nvme` offload.")
    overlap_comm: bool = Field(True, description="Overlap gradient reduction with the backward pass.")
    reduce_bucket_size: int = Field(
        500_000_000, ge=1, description="Elements reduced per bucket (written to the DeepSpeed JSON as an integer)."
    )
    stage3_prefetch_bucket_size: int = Field(50_000_000, ge=0, description="Stage 3: elements prefetched ahead.")
    stage3_max_live_parameters: int = Field(
        1_000_000_000, ge=0, description="Stage 3: gathered parameters kept alive before release, in elements."
    )
    stage3_max_reuse_distance: int = Field(
        1_000_000_000, ge=0, description="Stage 3: keep a gathered parameter if it is reused within this many elements."
    )
    sub_group_size: int = Field(1_000_000_000, ge=1, description="Stage 3: optimizer step sub-group, in elements.")
    hpz_partition_size: int = Field(
        0,
        ge=0,
        le=1024,
        description="ZeRO++ hpZ secondary weight partition (ranks). 0: processes per machine "
        "on a multi-machine run, off (1) on one machine. Must divide the world size.",
    )
    quantized_weights: bool | None = Field(
        None,
        description="ZeRO++ qwZ (int8 weight all-gather). null: on for CUDA float16/float32 runs, off with "
        "bfloat16 (its dequantized weights come back as float16) and on CPU (no CUDA quantizer kernels).",
    )
    quantized_gradients: bool | None = Field(
        None, description="ZeRO++ qgZ (int4 gradient reduce-scatter). null: on for CUDA runs, off on CPU."
    )


class PipelineOptions(Section):
    stages: int = Field(2, ge=1, le=16, description="Pipeline stages (pipeline_stages), one per process; >= 2.")
    schedule: Literal["1f1b", "gpipe"] = Field(
        "1f1b",
        description="1f1b: one-forward-one-backward, activations of at most `stages` microbatches alive; "
        "gpipe: all forwards, then all backwards.",
    )
    allow_cpu: bool = Field(
        False, description="Run the stages as CPU gloo processes (for testing on a machine without GPUs)."
    )


class ParallelismConfig(Section):
    gpus: Literal["auto"] | GpuCount = Field(
        "auto",
        description=f"GPUs to train on: `auto` (all visible; a CPU run when there are none) or 1..{MAX_GPU_COUNT}.",
    )
    strategy: Literal["auto", "ddp", "zero1", "zero2", "zero3", "zero++", "fsdp2", "pipeline", "tp"] = Field(
        "auto",
        description="Distribution strategy. auto: the planner chooses and says why. ddp: full replica per rank; "
        "zero1/zero2/zero3: DeepSpeed ZeRO sharding optimizer state / + gradients / + parameters; zero++ "
        "(alias zero_pp): ZeRO-3 with quantized communication and hpZ; fsdp2: torch fully_shard per decoder layer; "
        "pipeline: decoder layers split into stages (torch.distributed.pipelining); tp: tensor parallel (transformers "
        "tp_plan), full fine-tunes.",
    )
    cpu_processes: int = Field(
        2, ge=1, le=64, description="Processes per machine for a CPU (gloo) run, used when no GPU is present."
    )
    nodes: int = Field(
        1,
        ge=1,
        le=1024,
        description="Machines taking part. 1: this machine only. >1: every other machine joins with "
        "`ladle launch SPEC --node-rank R` (printed by the train stage).",
    )
    main_address: str = Field(
        "127.0.0.1", description="Address of the machine with node rank 0, where the rendezvous store listens."
    )
    main_port: int = Field(
        0, ge=0, le=65535, description="Rendezvous port on the main machine. 0: a free port (single machine only)."
    )
    ddp: DDPOptions = Field(default_factory=DDPOptions, description="DDP options.")
    fsdp2: FSDP2Options = Field(default_factory=FSDP2Options, description="FSDP2 options.")
    pipeline: PipelineOptions = Field(default_factory=PipelineOptions, description="Pipeline-parallel options.")
    deepspeed: DeepSpeedOptions = Field(
        default_factory=DeepSpeedOptions, description="DeepSpeed ZeRO options (zero1, zero2, zero3, zero++)."
    )

    @field_validator("strategy", mode="before")
    @classmethod
    def _alias_strategy(cls, value: Any) -> Any:
        return STRATEGY_ALIASES.get(value, value) if isinstance(value, str) else value

    @field_validator("gpus", mode="before")
    @classmethod
    def _parse_gpus(cls, value: Any) -> Any:
        return parse_gpus(value)


class ServeConfig(Section):
    backend: Literal["transformers", "mii"] = Field(
        "transformers", description="Inference backend. `mii` (DeepSpeed-MII) needs CUDA GPUs."
    )
    host: str = Field("127.0.0.1", description="Address the server binds.")
    port: int = Field(0, ge=0, le=65535, description="Port. 0: pick a free one.")
    max_new_tokens: int = Field(32, ge=1, le=8192, description="Default completion length, in tokens.")
    health_timeout_s: float = Field(180.0, gt=0, description="Seconds to wait for /health before failing.")
    smoke_prompt: str | None = Field(
        None,
        description="Chat message sent as the deploy stage's smoke request. null: the first held-out eval "
        "conversation, whose answer is then checked against its reference (`answer_correct`); with no held-out "
        "conversation, `Hello!`.",
    )
    keep_running: bool = Field(
        False,
        description="Leave the server running after the smoke request (its PID is reported). "
        "false: stop it when the pipeline ends.",
    )


class EvalConfig(Section):
    max_examples: int = Field(
        200,
        ge=0,
        le=100_000,
        description="Held-out eval conversations scored by exact match of greedy answers, for the base model "
        "(cached per base and data) and the merged model. 0: measure eval loss only.",
    )
    batch_size: int = Field(32, ge=1, le=1024, description="Prompts generated together while evaluating.")


class TrackingConfig(Section):
    uri: str | None = Field(
        None,
        description="MLflow tracking URI. null: sqlite in the output folder (in $LADLE_HOME/mlflow when "
        "output is remote).",
    )
    experiment: str = Field("ladle", description="MLflow experiment name.")
    registered_model: str | None = Field(
        None, description="Registered-model name for the merged model. null: the config's `name`."
    )
    ui_url: str = Field("http://127.0.0.1:5000", description="Base URL of the MLflow UI, for links.")


class LadleConfig(Section):
    schema_version: Literal[1] = Field(SCHEMA_VERSION, description="Config schema version.")
    name: str = Field(
        "ladle-run", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$", description="Run name (letters, digits, . _ -)."
    )
    base: str = Field(
        description="Base model: a Hugging Face model folder (local path or fsspec URL), or "
        "`ladle://tiny-llama` for the bundled tiny model created on first use."
    )
    task: Literal["sft"] = Field("sft", description="Training task: supervised fine-tuning.")
    data: DataConfig = Field(description="Dataset and preparation.")
    training: TrainingConfig = Field(default_factory=TrainingConfig, description="Optimisation.")
    parallelism: ParallelismConfig = Field(default_factory=ParallelismConfig, description="GPUs and strategy.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Task accuracy on the held-out split.")
    serve: ServeConfig = Field(default_factory=ServeConfig, description="Inference server.")
    tracking: TrackingConfig = Field(default_factory=TrackingConfig, description="MLflow tracking.")
    output: str = Field(
        "./runs", description="Artifact store root: a local folder or any fsspec URL (s3://bucket/prefix)."
    )


def parse_gpus(value: Any) -> Literal["auto"] | int:
    """Parse a ``--gpus`` / ``parallelism.gpus`` value.

    Raises:
        ValueError: for booleans, non-integers, and counts outside 1..MAX_GPU_COUNT.
    """
    if isinstance(value, bool):
        raise ValueError(f"must be 'auto' or an integer 1..{MAX_GPU_COUNT}, not a boolean")
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "auto":
            return "auto"
        if not text.isdigit():
            raise ValueError(f"must be 'auto' or an integer 1..{MAX_GPU_COUNT}")
        value = int(text)
    if not isinstance(value, int) or not 1 <= value <= MAX_GPU_COUNT:
        raise ValueError(f"must be 'auto' or an integer 1..{MAX_GPU_COUNT}")
    return value


def format_validation_error(err: ValidationError, source: str) -> list[str]:
    """Turn pydantic errors into ``field = value: problem. fix.`` lines."""
    lines = []
    for item in err.errors():
        path = ".".join(str(p) for p in item["loc"]) or "(root)"
        value = item.get("input")
        if item["type"] == "extra_forbidden":
            lines.append(f"{path}: unknown key in {source}. Remove it or check its spelling (see `ladle schema`).")
        elif item["type"] == "missing":
            lines.append(f"{path}: required but missing in {source}. Add it (see `ladle schema`).")
        else:
            msg = item["msg"].removeprefix("Value error, ")
            lines.append(f"{path} = {_short(value)}: {msg}. Fix it in {source} or with --set {path}=...")
    return lines


def _short(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


def load_config(path: str | Path, overrides: list[str] | None = None, gpus: str | None = None) -> LadleConfig:
    """Load a YAML config, apply ``--set`` overrides and ``--gpus``, validate.

    Raises:
        LadleError: the file is missing or not YAML.
        ConfigError: the tree does not validate (every problem listed).
    """
    path = Path(path)
    if not path.is_file():
        raise LadleError(f"config = {str(path)!r}: no such file. Pass the path of a YAML config (see recipes/).")
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
    try:
        return LadleConfig.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, source)) from None


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
        kind = _type_name(annotation).replace("|", "\\|")
        rows.append(f"| `{path}` | {kind} | `{default}` | {field.description} |")
    return rows


def _type_name(annotation: Any) -> str:
    text = str(annotation).replace("typing.", "").replace("<class '", "").replace("'>", "")
    return text.replace(
        "Annotated[int, FieldInfo(annotation=NoneType, required=True, metadata=[Ge(ge=1), Le(le=128)])]", "int 1..128"
    )
