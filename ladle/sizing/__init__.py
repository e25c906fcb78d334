"""Per-rank memory of a whole training step: the parts every strategy's estimate is made of.

Each strategy composes these in its ``estimate`` (``ladle.strategies``); model
states come from ``ladle.sizing.memory`` (DeepSpeed's layout, tested against its
estimators). On top of them:

- Activations saved for backward, per token per decoder layer. The coefficients
  were measured, not taken from the 34·s·h textbook constant: saved-tensor hooks
  on a Llama decoder block with SDPA attention (whose flash kernel keeps the
  log-sum-exp, not the s x s scores) count exactly
  ``20·h + 8·i + 4·kv + 4·heads + 8`` bytes in bf16/fp16 and
  ``32·h + 16·i + 8·kv + 4·heads + 8`` in fp32 (h hidden, i MLP width, kv the
  K/V projection width); ``tests/sizing/test_sizing.py`` re-measures them. With
  gradient checkpointing only each layer's input is kept, plus one layer
  recomputed at a time.
- Logits: the model-dtype logits, their fp32 upcast in the loss and the fp32
  log-softmax kept for backward: ``tokens · vocab · (dtype + 8)`` bytes.
- QLoRA: NF4 base linear weights at 0.5 bytes plus one fp32 absmax per 64
  weights (0.5625 bytes per weight); embeddings, norms and the head stay 16-bit.
- A fixed 1 GiB per GPU for the CUDA context and allocator slack, and 10 %
  headroom: a candidate fits when its total is at most 90 % of the device.

No torch import: ``ladle plan`` stays fast.
"""

from __future__ import annotations

from dataclasses import dataclass

from ladle.sizing import memory, params

GIB = 2**30
CONTEXT_BYTES = 1 * GIB
HEADROOM = 0.90
EVAL_LOSS_ROWS = 8
"""Packed rows the evaluate stage's loss runs at once at most (its logits are the eval term's transient)."""
EVAL_LOGITS_BYTES = 1 * GIB
"""What those rows' float32 logits may take: a 4096-token row of a 152k vocabulary alone is 2.5 GB."""
NF4_BYTES = 0.5 + 4 / 64
# Resident memory of a forward's activations on CPU hosts, per byte autograd saves. glibc serves the forward's
# sub-4 MiB blocks from its heap; the temporaries freed between saved tensors leave holes the next, differently
# sized tensors do not fill. Measured on the 0.38B bench Llama (128 tokens, float32, one process, the saved
# bytes counted with saved_tensors_hooks): full fine-tune 290 MiB saved, 347-357 MiB resident; LoRA (peft adds
# each adapter's output to the base output, both alive at once) 262 MiB saved, 446-483 MiB resident.
CPU_RESIDENT_ACTIVATIONS = {"full": 1.2, "lora": 1.75}
# What a CPU rank holds during its steps beyond the tensors counted and the pre-load baseline (the interpreter,
# the libraries imported, the process group and the data). Traced on the memory-truth test's model (2 gloo
# ranks, FSDP2, LoRA; resident memory at each gather): 24 MiB of module, adapter and sharding objects built
# around the model, and 18-25 MiB the first forward and backward leave behind after a heap trim (7 of them the
# code pages of the kernels first run, the rest autograd's and the collectives' lazy state). DDP's step on the
# same model: 25-35 MiB above its tensors. On GPUs the CUDA context term covers the like.
CPU_STEP_RUNTIME = 40 * 2**20


@dataclass(frozen=True)
class ModelShape:
    params: int
    trainable: int
    layers: int
    hidden: int
    intermediate: int  # active MLP width per token (MoE: routed experts per token x their width, + shared)
    kv_dim: int
    heads: int
    vocab: int
    embedding_params: int  # input embedding + untied head
    layer_params: int  # one decoder layer (the unit FSDP2/ZeRO-3 gathers)
    kv_heads: int = 0  # key/value heads (0: as many as the query heads)

    @property
    def linear_params(self) -> int:
        return self.params - self.embedding_params

    @property
    def untied(self) -> bool:
        """Whether the head is a weight of its own (not the input embedding's)."""
        return self.embedding_params == 2 * self.vocab * self.hidden

    @property
    def largest_tensor(self) -> int:
        """Elements of the largest single weight (the embedding, or an MLP projection)."""
        return max(self.vocab * self.hidden, self.hidden * self.intermediate)


def tensor_sizes(shape: ModelShape) -> list[int]:
    """Elements of each weight in a Llama-layout module's order: the embedding, each layer's attention
    projections and its MLP (the rest of the layer, as three projections), then the head when untied."""
    h, kv = shape.hidden, shape.kv_dim
    attention = [h * h, kv * h, kv * h, h * h]
    mlp = max(0, shape.layer_params - sum(attention)) // 3
    embedding = shape.vocab * h
    head = [embedding] if shape.embedding_params > embedding else []
    return [embedding, *(attention + [mlp] * 3) * shape.layers, *head]


def kv_dim_of(config: dict) -> int:
    """Width of one token's keys (or values) in one layer: key/value heads x head size, from ``config.json``."""
    heads = config["num_attention_heads"]
    return (config.get("num_key_value_heads") or heads) * (config.get("head_dim") or config["hidden_size"] // heads)


def kv_bytes(layers: int, kv_dim: int, tokens: int, dtype_bytes: int) -> int:
    """Keys and values of ``tokens`` cache columns over ``layers`` layers."""
    return tokens * 2 * layers * kv_dim * dtype_bytes


def shape_from_config(config: dict, trainable: int | None = None) -> ModelShape:
    """The sizes the memory model needs, from a ``config.json`` dict."""
    total, _ = params.count_params(config)
    h, n = config["hidden_size"], config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    kv = kv_dim_of(config)
    inter = config.get("intermediate_size", 4 * h)
    if config.get("moe_intermediate_size"):
        per_token = config.get("num_experts_per_tok", 2) + (config.get("n_shared_experts") or 0)
        inter = config["moe_intermediate_size"] * per_token + config.get("shared_expert_intermediate_size", 0)
    embed = config["vocab_size"] * h * (1 if config.get("tie_word_embeddings", False) else 2)
    return ModelShape(
        total,
        total if trainable is None else trainable,
        n,
        h,
        inter,
        kv,
        heads,
        config["vocab_size"],
        embed,
        (total - embed) // max(n, 1),
        config.get("num_key_value_heads") or heads,
    )


def activation_bytes_per_token_layer(shape: ModelShape, dtype_bytes: int) -> int:
    """Bytes saved for backward by one Llama-style decoder layer per token (measured coefficients)."""
    if dtype_bytes >= 4:
        return 32 * shape.hidden + 16 * shape.intermediate + 8 * shape.kv_dim + 4 * shape.heads + 8
    return 20 * shape.hidden + 8 * shape.intermediate + 4 * shape.kv_dim + 4 * shape.heads + 8


def activation_bytes(shape: ModelShape, tokens: int, layers: int, dtype_bytes: int, checkpointing: bool) -> int:
    """Activations alive at the end of the forward of ``tokens`` through ``layers`` layers."""
    full = activation_bytes_per_token_layer(shape, dtype_bytes) * tokens
    if checkpointing:
        return layers * shape.hidden * dtype_bytes * tokens + full  # layer inputs, plus one layer recomputed
    return layers * full


def kv_repeats(heads: int, kv_heads: int, sp: int) -> int:
    """How many times each KV head is repeated so the KV heads divide by ``sp`` and still map onto the query
    heads group by group (the smallest such factor; ``heads / kv_heads`` at most, plain multi-head attention)."""
    groups = heads // kv_heads
    return next((f for f in range(1, groups + 1) if not groups % f and not (kv_heads * f) % sp), groups)


def all_to_all_bytes(shape: ModelShape, tokens: int, dtype_bytes: int, sp: int = 1) -> int:
    """Ulysses' buffers beyond the activations a layer saves, on a rank holding ``tokens`` tokens: at the peak (the
    start of the backward) the last layer's exchange of the output gradient and of q, k and v's gradients back,
    one send and one receive copy each side of the attention: q + k + v + o once. What attention saves (q, k, v
    over the whole sequence and ``heads / sp`` heads) is the same size as without sp, and is in the per-token
    coefficients. On CPU processes (glibc, large blocks as their own mappings) the measured peak per rank at sp=2
    was the whole-row peak at half the row to 1 % (``bench/sequence_parallel.py``): the buffers of earlier
    layers are freed before the peak. KV heads that do not divide by ``sp`` are exchanged repeated
    (``kv_repeats``), so k and v are that many times wider in the exchange."""
    repeat = kv_repeats(shape.heads, shape.kv_heads or shape.heads, sp) if sp > 1 else 1
    return (2 * shape.hidden + 2 * shape.kv_dim * repeat) * tokens * dtype_bytes  # q, o hidden wide; k, v kv_dim


def logits_bytes(shape: ModelShape, tokens: int, dtype_bytes: int, chunk_bytes: int = 0, liger: bool = False) -> int:
    """The loss's logits: all ``tokens`` at once, or with a fused loss (``chunk_bytes`` of float32 logits at a
    time, recomputed in backward) one chunk's: its model-dtype logits, their float32 copy and the float32
    gradient of the recomputation. Liger's fused kernel sizes its chunks itself (tokens x hidden / vocab,
    rounded up to a power of two) and keeps the gradient of the head's input beside them."""
    if liger:
        ratio = -(-shape.vocab // max(shape.hidden, 1))
        chunk = 1 << max(0, (-(-tokens // ratio) - 1).bit_length())
        return min(tokens, chunk) * shape.vocab * (dtype_bytes + 4) + tokens * shape.hidden * dtype_bytes
    if chunk_bytes:
        tokens = min(tokens, max(1, chunk_bytes // (4 * shape.vocab)))
    return tokens * shape.vocab * (dtype_bytes + 8)


COMPILED_ACTIVATIONS = 0.75
"""Activations a compiled decoder block saves, per byte the eager block saves. Inductor's partitioner recomputes
cheap pointwise results (norms, SiLU, rotary) in backward instead of saving them. Measured on one H200 (bf16, LoRA
on every linear layer, DDP): the 8B shape at seq 4096 with attention example by example (no mask) saved 0.746 of
the eager coefficients' bytes (2026-11-28); with the block-diagonal mask, 0.815 (2026-11-26), the difference being
the mask SDPA saves per layer (``attention_mask_bytes``)."""


def attention_mask_bytes(layers: int, rows: int, seq_len: int, dtype_bytes: int) -> int:
    """What a packed row's block-diagonal mask adds on CUDA where attention is not run example by example
    (``training.kernels.packed_attention`` off, or a model whose attention ladle's cannot replace): transformers'
    boolean mask and the additive copy SDPA's memory-efficient kernel saves for backward, seq x seq each, per
    layer that saves its activations. Measured on one H200 (8B shape, seq 4096, 32 layers, 2026-11-28): the peak
    with the mask was 1,535 MiB above the peak without, and 32 x 4096^2 x (1 + 2) bytes is 1,536 MiB."""
    return layers * rows * seq_len * seq_len * (1 + dtype_bytes)


# FSDP2's vocabulary-parallel loss computes the float32 logits of at most this many bytes of token rows at once.
LOGITS_CHUNK_BYTES = 64 * 2**20


def vocab_parallel_logits_bytes(
    shape: ModelShape, tokens: int, dtype_bytes: int, ranks: int, budget: int = LOGITS_CHUNK_BYTES
) -> int:
    """The logits of a vocabulary-parallel loss: every rank's ``tokens`` over this rank's 1/``ranks`` of the
    vocabulary, a chunk of rows (``budget`` bytes of float32) at a time. The chunk's float32 logits are
    made into exponentials, probabilities and their gradient in place; a 16-bit run also holds the matmul's
    16-bit output while upcasting it, and the gradient's 16-bit copy for the backward's matmul."""
    vocab_rows = -(-shape.vocab // ranks)
    rows = min(ranks * tokens, max(1, budget // (4 * vocab_rows)))
    return rows * vocab_rows * (4 + (dtype_bytes if dtype_bytes < 4 else 0))


@dataclass(frozen=True)
class Estimate:
    """One candidate's per-rank device memory, by part, in bytes."""

    strategy: str
    weights: int
    gradients: int
    optimizer: int
    gathered: int
    activations: int
    logits: int
    host: int = 0
    note: str = ""
    context: int = CONTEXT_BYTES  # the runtime's fixed memory: the CUDA context, or a CPU engine's own (ZeRO)
    load: int = 0  # held at the end of loading: this rank's weights plus the largest tensor being read
    step: int = 0  # the optimizer step's temporaries (activations are freed by then)
    save: int = 0  # what rank 0 gathers at once to save, beside the states (CPU runs: on a GPU it goes to the host)
    runtime: int = 0  # a CPU rank's lazily built runtime during its steps (CPU_STEP_RUNTIME)
    rollout: int = 0  # grpo: what sampling adds to the states (KV cache, logits, weights gathered whole)
    kept: int = 0  # grpo on a CPU: what the rollouts freed (KV cache, logits, gathered weights) the heap keeps
    reference: int = 0  # grpo, full fine-tune with beta > 0: the frozen starting weights the KL is measured against

    @property
    def states(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.reference

    @property
    def peak(self) -> int:
        """The largest of loading, a training step, saving the outputs and grpo's rollouts (``sampling``)."""
        return max(
            self.total,
            self.load + self.context,
            self.states + self.save + self.context,
            self.sampling,
        )

    @classmethod
    def of(
        cls,
        label: str,
        states: memory.ModelStates,
        activations: int,
        logits: int,
        job: Job,
        note: str = "",
        load: int = 0,
        step: int = 0,
        save: int = 0,
    ):
        """An estimate from model states plus activations and logits (the CUDA context on GPUs)."""
        return cls(
            label,
            states.weights,
            states.gradients,
            states.optimizer,
            states.gathered,
            activations,
            logits,
            states.host,
            note,
            CONTEXT_BYTES if job.cuda else 0,
            load,
            step,
            save,
            0 if job.cuda else CPU_STEP_RUNTIME,
        )

    @property
    def total(self) -> int:
        """A training step: the states, plus the larger of the forward/backward's transients (gathered weights,
        activations, logits) and the optimizer step's (on CPU hosts, with the runtime the steps build)."""
        transient = max(self.gathered + self.activations + self.logits, self.step)
        return self.states + transient + self.runtime + self.context + self.kept

    @property
    def sampling(self) -> int:
        """grpo's rollouts: the states, what sampling adds, the runtime (0 for other objectives)."""
        return self.states + self.rollout + self.runtime + self.context if self.rollout else 0

    def fits(self, device_bytes: int) -> bool:
        return max(self.total, self.sampling) <= HEADROOM * device_bytes

    def summary(self) -> str:
        parts = (
            ("weights", self.weights),
            ("grads", self.gradients),
            ("optimizer", self.optimizer),
            ("gathered", self.gathered),
            ("reference", self.reference),
            ("activations", self.activations),
            ("logits", self.logits),
        )
        parts += (("CUDA context" if self.context == CONTEXT_BYTES else "engine", self.context),)
        parts += (("CPU runtime", self.runtime),)
        text = f"{gib(self.total)}/rank (" + ", ".join(f"{k} {gib(v)}" for k, v in parts if v) + ")"
        if self.step:
            text += f"; optimizer step temporaries {gib(self.step)}, once the activations are freed"
        return text


def usable(capacity: int) -> str:
    """What a rank may plan to use of ``capacity`` bytes (``HEADROOM``), in words: "72.0 GiB usable"."""
    return f"{gib(HEADROOM * capacity)} usable"


def gib(value: float) -> str:
    """Bytes as GiB (MiB below 1 GiB)."""
    return f"{value / GIB:.1f} GiB" if value >= GIB else f"{value / 2**20:.1f} MiB"


@dataclass(frozen=True)
class Job:
    """What is trained, and how, for the memory model."""

    shape: ModelShape
    lora: bool
    qlora: bool
    micro_batch: int
    seq_len: int
    dtype_bytes: int
    checkpointing: bool
    gpus_per_node: int
    nodes: int
    microbatches: int = 1  # pipeline: microbatches per step
    cuda: bool = True
    save_shard_bytes: int = 512 * 2**20  # training.save_shard_mib: the part of a full model rank 0 gathers at once
    trained_ends: bool = False  # LoRA's modules_to_save trains the embedding or the head (params.trains_ends)
    loss_chunk_bytes: int = 0  # training.kernels.fused_loss: float32 logits of one chunk (0: the plain loss)
    liger_loss: bool = False  # Liger's fused linear cross-entropy runs (CUDA, installed where the plan is made)
    compiled: bool = False  # training.kernels.compile: blocks compiled where the strategy compiles them
    attention: str | None = None  # why ladle's attention layers cannot run this model's (None: they can)
    masked: bool = False  # packed rows reach attention as a block-diagonal mask (CUDA, attention not by example)
    rollout_bytes: int = 0  # grpo: the rollouts' KV cache, sampling logits and log-probability buffers per rank
    rollout_merged: int = 0  # grpo: of rollout_bytes, the adapted weights merged for sampling (LoRA)
    completion_tokens: int = 0  # grpo: the completion part of each row (the rest is its prompt); logits only there
    shared_prompts: int = 0  # grpo: prompts a micro-batch runs once for its rows (0: each row with its own copy)
    frozen_reference: bool = False  # grpo: a frozen copy of the starting weights (full fine-tune with beta > 0)

    def forward_tokens(self) -> int:
        """Tokens a micro-batch's forward runs with gradients: its rows' whole length, or under grpo's shared
        prompts each distinct prompt once and every row's completion."""
        if not self.shared_prompts:
            return self.micro_batch * self.seq_len
        return self.shared_prompts * (self.seq_len - self.completion_tokens) + self.micro_batch * self.completion_tokens

    def logit_tokens(self) -> int:
        """Positions whose logits the loss takes: every token, or under grpo the completions' only."""
        return self.micro_batch * (self.completion_tokens or self.seq_len)

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes


def lora_states(
    job: Job, base_ranks: int, offload_params: bool = False, ends_gathered: bool = True
) -> memory.ModelStates:
    """LoRA (and QLoRA) states per rank: the frozen base divided over ``base_ranks`` ranks, states only for
    what is trained (``shape.trainable``: the adapters and any modules_to_save copies), divided with the base;
    ``offload_params`` keeps the base in host memory; ``ends_gathered``: a sharded base's
    embedding and head are gathered whole (false: FSDP2's vocabulary-parallel ends, never gathered)."""
    s = job.shape
    base = memory.lora(s.params, s.trainable, base_ranks, shard_base=base_ranks > 1)
    if job.dtype_bytes == 4:  # a float32 run (CPU): 4-byte base and adapters, torch AdamW's moments
        adapters = memory.fp32(s.trainable, base_ranks)  # sharded with the base where the base is
        base = memory.ModelStates(
            4 * s.params // base_ranks + adapters.weights, adapters.gradients, adapters.optimizer, 0
        )
    if base_ranks > 1:
        # A sharded base is gathered a layer at a time: in the backward, the layer being differentiated and the
        # next one prefetched (FSDP2's gathers write in place on gloo too: ``runtime.gloo_gather``); with the
        # ends gathered, the embedding and the head are the largest units beside a layer.
        gathered = job.dtype_bytes * (s.layer_params + (s.embedding_params if ends_gathered else s.layer_params))
        base = memory.ModelStates(base.weights, base.gradients, base.optimizer, gathered)
    if offload_params:
        host = memory.WEIGHT_16 * s.params // job.nodes
        base = memory.ModelStates(memory.WEIGHT_16 * s.trainable, base.gradients, base.optimizer, 0, host)
    if job.qlora:  # 4-bit linear weights; only the 16-bit embeddings and head keep 2 bytes
        quantized = int((s.linear_params * NF4_BYTES + s.embedding_params * memory.WEIGHT_16) / base_ranks)
        base = memory.ModelStates(quantized + memory.WEIGHT_16 * s.trainable, base.gradients, base.optimizer, 0)
    return base


MERGE_SHARD_BYTES = 5 * GIB  # the largest safetensors shard Hugging Face writes by default (max_shard_size 5GB)


def merge_bytes(shape: ModelShape, dtype_bytes: int) -> int:
    """Host memory of the streaming merge (``ladle.lifecycle.merge``): one output shard of the base, plus the tensor being
    folded in float32 (weight, and B @ A) and its stored copy."""
    shard = min(shape.params * dtype_bytes, MERGE_SHARD_BYTES)
    return shard + shape.largest_tensor * (4 + 4 + dtype_bytes)


def prefill_bytes(shape: ModelShape, dtype_bytes: int, tokens: int) -> int:
    """The transient of prefilling ``tokens`` prompt tokens at once, one layer's worth (layers run one after
    another): the hidden states with their norm and attention input and output (4 x hidden), and the MLP's gate,
    up and activated rows (3 x intermediate). Its logits are one row per request (``logits_to_keep``), counted
    with the decode step's."""
    return tokens * (4 * shape.hidden + 3 * shape.intermediate) * dtype_bytes


def serve_bytes(shape: ModelShape, dtype_bytes: int, batch: int, tokens_per_request: int, shards: int = 1) -> int:
    """Device memory of one serving replica: the merged weights, the KV cache of ``batch`` requests of
    ``tokens_per_request`` tokens (keys and values, every layer), one step's float32 logits (one row per request,
    prefill included) and the largest prefill (the whole batch's prompts joining at once, at most the KV budget);
    weights and cache divided over ``shards`` tensor-parallel devices."""
    weights = shape.params * dtype_bytes
    kv = kv_bytes(shape.layers, shape.kv_dim, batch * tokens_per_request, dtype_bytes)
    logits = batch * shape.vocab * 4
    return (weights + kv) // shards + logits + prefill_bytes(shape, dtype_bytes, batch * tokens_per_request)


def spread_over(weight_bytes: int, transient_bytes: int, devices: int, device_bytes: int | None) -> int:
    """Devices one copy of a model takes for evaluation and the transformers backend: 1 when its weights, what
    the stage holds beside them (the eval loss's logits, the server's KV cache) and the CUDA context fit one
    device with headroom, else every device (accelerate's ``device_map="auto"`` places consecutive layers on
    each; one computes at a time). The planner and the loaders call this one rule, so the plan's figures are
    what runs."""
    need = weight_bytes + transient_bytes + CONTEXT_BYTES
    if devices <= 1 or device_bytes is None or need <= HEADROOM * device_bytes:
        return 1
    return devices


def eval_loss_rows(tokens: int, vocab: int) -> int:
    """Rows the eval loss runs at once: up to ``EVAL_LOSS_ROWS`` while their logits fit ``EVAL_LOGITS_BYTES``."""
    return max(1, min(EVAL_LOSS_ROWS, EVAL_LOGITS_BYTES // max(tokens * vocab * 4, 1)))


def eval_bytes(shape: ModelShape, dtype_bytes: int, tokens: int, devices: int = 1) -> int:
    """Device memory of evaluating one copy of the merged model over ``devices``: its weights' share, and on
    the device that holds the head, the float32 logits of the loss's rows of ``tokens`` (``eval_loss_rows``)."""
    rows = eval_loss_rows(tokens, shape.vocab)
    return shape.params * dtype_bytes // devices + rows * tokens * shape.vocab * 4
