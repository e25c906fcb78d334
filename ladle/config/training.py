"""Config sections of the training half: the data, LoRA and quantization, the training loop and its kernels,
and parallelism (with each registered strategy's options section)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, create_model, field_validator, model_validator

from ladle import strategies
from ladle.config.rl import BUILTIN_REWARDS, EpisodeConfig, RewardConfig, RLConfig  # noqa: F401 (re-exported)
from ladle.section import Section

MAX_GPU_COUNT = 128


FORMAT_NAMES = Literal[
    "auto", "alpaca", "sharegpt", "messages", "chatml", "text", "tokenized", "preference", "kto", "prompt"
]


class DataSource(Section):
    """One source of a mix (``data.sources``): its files, its share, and how its rows read."""

    path: str = Field(
        description="The source's files: a local path or fsspec URL, globs allowed (as data.path), or a "
        "`ladle://` demo set."
    )
    name: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$",
        description="Its name in the data report and the run's metrics. null: the file name, without suffixes.",
    )
    weight: float | None = Field(
        None,
        gt=0,
        description="Its share among the weighted sources: they are mixed in proportion to their weights, as many "
        "rows as the sources allow without repeating one (the source that runs out first is used whole, the "
        "others sampled with data.seed). Default 1 when neither rows nor epochs is set.",
    )
    rows: int | None = Field(
        None,
        ge=1,
        le=10**10,
        description="A fixed number of training rows from it: fewer than it has are sampled with data.seed, more "
        "repeat it whole first (each repeat a pass over the source).",
    )
    epochs: float | None = Field(
        None,
        gt=0,
        le=1000,
        description="Passes over it: 3 repeats every row three times (a small, precious set), 0.5 samples half.",
    )
    format: FORMAT_NAMES | None = Field(None, description="Its record format. null: data.format.")
    system_prompt: str | None = Field(None, description="Its system turn. null: data.system_prompt.")
    train_on: Literal["response", "all"] | None = Field(None, description="Its trained tokens. null: data.train_on.")

    @model_validator(mode="after")
    def _one_share(self) -> DataSource:
        given = [name for name in ("weight", "rows", "epochs") if getattr(self, name) is not None]
        if len(given) > 1:
            values = ", ".join(f"{name} = {getattr(self, name)}" for name in given)
            raise ValueError(f"{values}: give one of weight, rows and epochs per source")
        return self

    @field_validator("path")
    @classmethod
    def _no_password(cls, value: str) -> str:
        from ladle.platform.secrets import refuse_url_password

        return refuse_url_password(
            value,
            "data.sources[].path",
            "Give the store's credentials through its own settings and drop user:password@ from the URL",
        )

    def label(self) -> str:
        """``name``, or the file name of ``path`` without its suffixes."""
        if self.name:
            return self.name
        tail = self.path.rstrip("/").rsplit("/", 1)[-1]
        return tail.split(".", 1)[0] or tail


class DataConfig(Section):
    path: str | None = Field(
        None,
        description="Training data: a local path or fsspec URL (s3://, memory://), globs allowed, of JSONL, "
        "JSON, Parquet or CSV files (by suffix; .gz etc. decompressed), or `ladle://demo-alpaca` for the "
        "bundled generated demo set. Give this or data.sources.",
    )
    sources: list[DataSource] | None = Field(
        None,
        min_length=1,
        max_length=64,
        description="Several sources mixed into one training set, each with its share (weight, rows or epochs) and "
        "its own format, system_prompt and train_on; mixed with data.seed, the same on any number of GPUs. The "
        "held-out rows are data.eval_ratio of each source (or data.eval_path). Give this or data.path.",
    )
    format: FORMAT_NAMES = Field(
        "auto",
        description="Record format. `alpaca`: instruction/input/output; `sharegpt`: conversations of "
        "{from, value}; `messages`/`chatml`: messages of {role, content}; `text`: a `text` field; "
        "`tokenized`: `input_ids` (and optional `labels`); `preference` (training.objective: dpo): chosen and "
        "rejected, with a prompt (string or turns), as whole conversations sharing the prompt, or after ShareGPT "
        "conversations; `kto` (training.objective: kto): TRL's unpaired preferences, a prompt, a completion and a "
        "label (true: desirable); `prompt` (training.objective: grpo): a `prompt` (a string, used as it is, or a message list, "
        "rendered by the chat template with the assistant's turn opened), and any other columns, which the "
        "rewards receive. `auto` detects it from the first record.",
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
    seq_len: int = Field(
        256,
        ge=16,
        le=131072,
        description="Tokens per packed training row. With `training.objective: dpo`, the longest one side of a pair "
        "may be (prompt and completion); a pair's row holds both sides, 2 x seq_len tokens.",
    )
    max_prompt_tokens: int | None = Field(
        None,
        ge=1,
        description="Preference pairs (`training.objective: dpo`): a prompt longer than this keeps its last "
        "max_prompt_tokens tokens (the turn the completion answers stays whole); then the completion is cut "
        "to fit seq_len. Both are counted in the data report. null: only the seq_len rule.",
    )
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

    @model_validator(mode="after")
    def _path_or_sources(self) -> DataConfig:
        if self.path is None and not self.sources:
            raise ValueError("neither data.path nor data.sources is set: give data.path (one source) or data.sources")
        if self.path is not None and self.sources:
            raise ValueError(
                f"data.path = {self.path!r} and data.sources are both set: give data.path for one source, or move it "
                "into data.sources"
            )
        if self.sources:
            labels = [s.label() for s in self.sources]
            twice = sorted({label for label in labels if labels.count(label) > 1})
            if twice:
                raise ValueError(
                    f"data.sources: the name(s) {twice} are given to more than one source; set each one's `name`"
                )
        return self

    def source_list(self) -> list[DataSource]:
        """The sources: ``data.sources``, or ``data.path`` as the one source."""
        return list(self.sources) if self.sources else [DataSource(path=self.path or "")]

    def describe(self) -> str:
        """How error messages name the data: ``data.path = '...'`` or the sources' paths."""
        if self.sources:
            return "data.sources = [" + ", ".join(repr(s.path) for s in self.sources) + "]"
        return f"data.path = {self.path!r}"

    @field_validator("path", "eval_path")
    @classmethod
    def _no_password_in_urls(cls, value: str | None, info) -> str | None:
        from ladle.platform.secrets import refuse_url_password

        return refuse_url_password(
            value,
            f"data.{info.field_name}",
            "Give the store's credentials through its own settings (the variables fsspec reads, such as "
            "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, or a netrc file for http) and drop user:password@ from the URL",
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

    padding_free: bool | Literal["auto"] = Field(
        "auto",
        description="Join a micro-batch's packed rows into one row of their real tokens (padding dropped, "
        "attention kept within each example), for each micro-batch where that computes less: the padding no "
        "longer runs through every layer, the one longer row adds attention pairs; the model's config prices "
        "both. auto: on for ddp, zero1, zero2, zero3, zero++ and fsdp2 (the strategies that run the model's "
        "own forward); pipeline, tensor and N-D stages keep fixed row shapes. Under grpo: each micro-batch's "
        "completions scored as one row of their real tokens on their prompts' keys and values (attention per "
        "completion), where the model's attention is plain causal attention and activations are not recomputed.",
    )
    packed_attention: bool | Literal["auto"] = Field(
        "auto",
        description="Attention example by example in packed rows: each example's queries, keys and values "
        "regrouped into a batch of their own and causal SDPA run over it, instead of SDPA over the whole row "
        "with a block-diagonal mask (every query-key pair of the row computed). For model types with plain "
        "causal attention (Llama, Mistral without a sliding window, Qwen2/3, Phi-3, OLMo, Gemma). auto: on for "
        "ddp, zero1, zero2, zero3, zero++ and fsdp2 (on CUDA, causal SDPA per example runs the flash kernel: "
        "1.26x the masked path's tokens/s on the 8B LoRA row, and no mask saved per layer).",
    )
    lora_fused: bool | Literal["auto"] = Field(
        "auto",
        description="Each plain LoRA layer's forward and backward as one autograd function: where a call has more "
        "tokens than the harmonic mean of the layer's input and output widths, one product with W + s·B·A (made "
        "for the call and freed; only the input kept for the backward), else peft's three products with the "
        "scale and sum fused; the same gradients. Layers with dropout, a variant (DoRA), a quantized base or "
        "mixed dtypes keep peft's forward. auto: on for CPU runs under ddp, zero1, zero2 and fsdp2 (not yet "
        "run on a GPU); zero3 and zero++ gather each module's weights as it is called and keep peft's layers.",
    )
    lora_compute: Literal["run_dtype", "float32"] = Field(
        "run_dtype",
        description="run_dtype: LoRA adapters compute in the run's 16-bit dtype under autocast, their weights "
        "kept in float32 as the optimizer's master copy; float32: peft's default, which casts each adapted "
        "input to float32 (one more activation saved per adapted layer).",
    )


class PreferenceConfig(Section):
    """Preference tuning (``training.objective: dpo`` or ``kto``): the loss over (chosen, rejected) pairs or
    judged answers, and how the reference model's log-probabilities are obtained. Defaults are TRL's ``DPOConfig``'s
    and ``KTOConfig``'s."""

    loss: Literal["sigmoid", "ipo", "robust", "simpo"] = Field(
        "sigmoid",
        description="sigmoid: DPO, -log sigmoid(beta x margin of the log-ratios against the reference); ipo: "
        "(margin of the per-token average log-ratios - 1/(2 beta))^2; robust: DPO with label noise "
        "(label_smoothing: the chance a pair's preference is flipped); simpo: reference-free, the margin of the "
        "policy's per-token average log-probabilities minus simpo_gamma/beta (no reference pass at all).",
    )
    beta: float = Field(
        0.1, gt=0, le=100, description="How far the policy may move from the reference (DPO's and KTO's beta)."
    )
    desirable_weight: float = Field(
        1.0,
        gt=0,
        le=100,
        description="kto: the weight of a desirable answer's loss (TRL's; raise it when desirable answers are "
        "fewer: KTO's paper keeps desirable x weight / (undesirable x weight) within [1, 4/3]).",
    )
    undesirable_weight: float = Field(1.0, gt=0, le=100, description="kto: the weight of an undesirable answer's loss.")
    label_smoothing: float = Field(
        0.0,
        ge=0.0,
        lt=0.5,
        description="robust and simpo: the assumed probability that a pair's preference is wrong. 0: none.",
    )
    simpo_gamma: float = Field(0.5, ge=0.0, description="simpo: the target reward margin (SimPO's gamma).")
    sft_weight: float = Field(
        0.0,
        ge=0.0,
        le=100.0,
        description="Adds this times the chosen completion's negative log-likelihood (its per-token mean) to each "
        "pair's loss, as RPO does and TRL's loss_type [sigmoid, sft] (which averages tokens over its micro-batch "
        "instead): DPO alone can lower the chosen answers' likelihood along with the rejected ones'. 0: off.",
    )
    reference: Literal["auto", "precomputed", "adapters_off"] = Field(
        "auto",
        description="Where the reference log-probabilities come from. precomputed: one no-grad pass over the "
        "pairs before the first step, by the model as loaded (which is the reference: LoRA adapters start at "
        "zero), kept with the run and reused on resume: no reference weights are held while training, under any "
        "strategy. adapters_off: LoRA only, the base with the adapters disabled, one extra no-grad forward per "
        "micro-batch. auto: the planner's choice (precomputed; the plan says why in GiB).",
    )
    disable_dropout: bool = Field(
        True,
        description="Turn every dropout of the policy off for the run (LoRA's lora_dropout, the model's dropout "
        "layers and attention dropout), as TRL's DPOConfig does by default: the reference is scored without "
        "dropout, and a policy with it would compare noisy log-probabilities against it.",
    )


class TrainingConfig(Section):
    objective: Literal["sft", "dpo", "kto", "grpo"] = Field(
        "sft",
        description="sft: next-token cross-entropy on conversations; dpo: preference tuning on (prompt, chosen, "
        "rejected) pairs with the loss in `training.preference` (DPO, IPO, robust DPO or SimPO); kto: on unpaired "
        "answers judged desirable or not (prompt, completion, label: the shape of users' thumbs up and down), TRL's "
        "KTO loss with training.preference's beta and weights; grpo: online "
        "reinforcement learning on prompts, completions sampled by ladle's engine and scored by "
        "`training.rl.rewards` (GRPO, Dr. GRPO, DAPO, CISPO, SAPO, GSPO). With grpo, micro_batch_size and "
        "global_batch_size count completions, as TRL's do.",
    )
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
    seed: int = Field(
        42,
        ge=0,
        lt=2**63,
        description="Seed for initialisation, data order, dropout and GRPO's rollouts (0 to 2**63 - 1: what "
        "every random generator takes).",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Training dtype. auto: float32 on CPU, bfloat16 on GPUs that support it."
    )
    gradient_checkpointing: bool | Literal["auto"] = Field(
        "auto",
        description="Recompute each layer's activations in backward instead of keeping them (less memory, about "
        "a third more compute). auto: on only when the memory model finds that nothing fits the device without "
        "it (the plan says which), else off.",
    )
    checkpoint_every: int = Field(
        0, ge=0, description="Write a resumable checkpoint every N optimizer steps. 0: only at the end."
    )
    preempt_grace_s: float = Field(
        120.0,
        ge=5,
        le=86400,
        description="Seconds a run asks for between being told to stop (SIGTERM, or Slurm's SIGUSR1) and its end: "
        "the step in progress finishes, every rank writes a checkpoint of it, and the run exits 75 to be requeued "
        "(the Slurm backend requeues the job, which resumes from that checkpoint). Slurm sends SIGUSR1 this long "
        "before the time limit (`--signal`); the launchers wait this long before killing a rank. Longer than a "
        "step plus a checkpoint.",
    )
    eval_every: int = Field(0, ge=0, description="Evaluate every N steps. 0: only before and after training.")
    save_shard_mib: int = Field(
        512,
        ge=1,
        le=65536,
        description="Largest safetensors file of a saved full fine-tune, MiB. Rank 0 gathers and writes one file "
        "at a time, so saving adds at most this (or one larger tensor) to its memory.",
    )
    preference: PreferenceConfig = Field(
        default_factory=PreferenceConfig, description="Preference tuning (objective: dpo): loss and reference."
    )
    rl: RLConfig = Field(
        default_factory=RLConfig, description="Online RL (objective: grpo): group, sampling, rewards and loss."
    )
    lora: LoraConfig = Field(default_factory=LoraConfig, description="LoRA adapter settings.")
    quantization: QuantizationConfig = Field(
        default_factory=QuantizationConfig, description="Base-model quantization (QLoRA)."
    )
    kernels: KernelsConfig = Field(
        default_factory=KernelsConfig, description="Fast paths of the training step (fused loss, compile, Liger)."
    )


GpuCount = Annotated[int, Field(ge=1, le=MAX_GPU_COUNT)]


STRATEGY_PREAMBLE = "Distribution strategy. auto: the planner chooses and says why. "


class ParallelismBase(Section):
    gpus: Literal["auto"] | GpuCount = Field(
        "auto",
        description=f"GPUs to train on: `auto` (all visible; a CPU run when there are none) or 1..{MAX_GPU_COUNT}.",
    )
    strategy: str = Field(
        "auto",
        description=STRATEGY_PREAMBLE + "Any registered strategy (`ladle schema --markdown` lists them).",
        json_schema_extra=strategies.REGISTRY.schema(STRATEGY_PREAMBLE, ("auto",)),
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

    _known_strategy = field_validator("strategy", mode="before")(strategies.REGISTRY.validator("auto"))

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
