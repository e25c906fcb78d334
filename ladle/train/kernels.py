"""The fast paths of a training step (``training.kernels``): what the plan decides, and what the worker applies.

- **Fused loss**: the output head and the cross-entropy run a chunk of tokens at a time and are recomputed in
  backward, so the step never holds full-vocabulary float32 logits (a 4096-token row of a 128k vocabulary is
  2 GiB of them, and the plain path keeps the 16-bit logits, their float32 copy and the log-softmax). On CUDA
  with ``liger-kernel`` installed and a plain ``nn.Linear`` head, Liger's fused linear cross-entropy does the
  same in Triton. Only trained positions (labels not ignored) reach the head.
- **Per-block compile**: ``torch.compile`` of each decoder block in place (parameter names keep no
  ``_orig_mod.`` prefix), for DDP, ZeRO-1/2 and FSDP2 (which compiles in its ``wrap``, before sharding).
- **Liger kernels**: RMSNorm, SwiGLU and rotary embeddings, patched into the model instance, where the blocks
  are not compiled (inductor fuses the same operations itself).
- **LoRA compute in the run's dtype**: peft casts each adapted input to its adapters' dtype; under DDP's
  autocast the adapters are float32 master weights, so every adapted layer saved a float32 copy of its input.
  With the cast off, autocast runs the adapter matmuls in 16-bit from the float32 weights.
- **Fused LoRA layers**: each plain LoRA layer's forward and backward as one autograd function
  (``ladle.train.lora_fused``), through ``W + s·B·A`` where a call's tokens make that cheaper.
- **Padding-free micro-batches**: a micro-batch's rows joined into one row of their real tokens where that
  computes less (``ladle.train.padding_free``).
- **Attention example by example** in packed rows (``ladle.train.packed_attention``): causal SDPA over each
  example instead of masked SDPA over the whole row.

The plan resolves what it can from the config, the strategy's traits and the device (``ladle.plan.kernels``);
the worker resolves the rest on the training host (here) and reports what ran in the result.
"""

from __future__ import annotations

from typing import Any

from ladle import strategies
from ladle.plan.kernels import liger_importable
from ladle.train import run_state

# Model types whose causal-LM forward returns the head's output unchanged (no soft-capping or logit scale).
PLAIN_HEAD_TYPES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "phi3",
    "olmo",
    "olmo2",
    "gemma",
)


# -- worker side ---------------------------------------------------------------------------------------------


def apply_liger(model, decided: dict, device: str) -> str:
    """Patch Liger's RMSNorm/SwiGLU/RoPE into ``model`` (the Hugging Face model, before peft) where decided."""
    wanted = decided.get("liger", "off")
    if wanted == "off":
        return "off"
    model_type = getattr(model.config, "model_type", "")
    if device != "cuda" or not liger_importable():
        if wanted == "on":
            raise RuntimeError(
                "training.kernels.liger = true: liger-kernel is not installed on this training host "
                "(pip install liger-kernel) or the run is not on CUDA. Set training.kernels.liger=auto or false."
            )
        return "off: liger-kernel not installed" if device == "cuda" else "off: CPU"
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN, _apply_liger_kernel_to_instance

    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        if wanted == "on":
            raise RuntimeError(
                f"training.kernels.liger = true: liger-kernel has no kernels for model type {model_type!r}. "
                "Set training.kernels.liger=auto or false."
            )
        return f"off: no Liger kernels for {model_type}"
    _apply_liger_kernel_to_instance(
        model, rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False
    )
    return "on: RMSNorm, SwiGLU, RoPE"


def lora_in_run_dtype(model, decided: dict, strategy: str, device: str) -> str:
    """Stop peft casting adapted inputs to float32 where autocast computes the adapters in 16-bit anyway."""
    if decided.get("lora_compute") != "run_dtype" or device != "cuda":
        return "float32" if device == "cuda" else "float32 (CPU run)"
    if not strategies.get(strategy).autocast:
        return "run dtype (the strategy keeps adapters in it)"
    layers = [m for m in model.modules() if hasattr(m, "cast_input_dtype_enabled")]
    for layer in layers:
        layer.cast_input_dtype_enabled = False
    return f"run dtype under autocast ({len(layers)} adapted layers, float32 master weights)"


def fuse_lora(model, decided: dict) -> str:
    """Give ``model``'s plain LoRA layers the fused forward and backward where the plan decided to
    (``ladle.train.lora_fused``); what runs, in words."""
    if not decided.get("lora_fused"):
        return "off"
    from ladle.train import lora_fused

    layers = lora_fused.install(model)
    return f"on: {layers} adapted layers" if layers else "off: no plain LoRA layer"


def decoder_layers(model) -> list:
    """The transformer blocks (``*DecoderLayer`` modules of HF causal LMs): FSDP2's units, the compiled blocks."""
    return [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]


def compile_blocks(model, decided: dict, strategy: str) -> str:
    """Compile each decoder block in place (FSDP2 does it itself before sharding)."""
    if not decided.get("compile"):
        return "off"
    layers = decoder_layers(model)
    if not strategies.get(strategy).compiles_in_wrap:
        for layer in layers:
            layer.compile()
    return f"on: {len(layers)} blocks"


def fused_head(model, decided: dict, device: str) -> str:
    """Install the fused loss on ``model``'s output head (see ``FusedHead``); what runs, in words."""
    wanted = decided.get("fused_loss", "off")
    if wanted == "off":
        return "off"
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", "")
    if model_type not in PLAIN_HEAD_TYPES:
        return f"off: {model_type or 'this model'}'s forward may transform the head's output"
    head = model.get_output_embeddings()
    if head is None:
        return "off: the model has no output head"
    import torch

    liger_ok = device == "cuda" and type(head) is torch.nn.Linear and liger_importable()
    if wanted == "liger" and not liger_ok:
        raise RuntimeError(
            "training.kernels.fused_loss = liger: needs CUDA, liger-kernel installed on the training host and a "
            f"plain linear head (this one is {type(head).__name__}). Set training.kernels.fused_loss=chunked or auto."
        )
    mode = "liger" if wanted == "liger" or (wanted == "auto" and liger_ok) else "chunked"
    vocab = getattr(config, "vocab_size", 0) or 1
    chunk = max(1, decided.get("loss_chunk_mib", 256) * 2**20 // (4 * vocab))
    run_state.on(model).fused = FusedHead.install(head, mode, chunk)
    return "liger fused linear cross-entropy" if mode == "liger" else f"chunked: {chunk} tokens at a time"


class FusedHead:
    """Replaces one head module's ``forward`` (its hooks, parameters and names stay as they were).

    ``token_loss`` hands it the labels just before the model's forward (``expect``); the head's forward then
    returns the summed cross-entropy of the trained positions instead of logits, and the causal LM passes it
    through as ``logits`` (the model types in ``PLAIN_HEAD_TYPES`` do not touch the head's output). Without
    labels handed over it is the plain head.
    """

    def __init__(self, head, mode: str, chunk: int) -> None:
        self.head, self.mode, self.chunk = head, mode, chunk
        self.original = head.forward
        self.labels = None
        self.per_token = False
        self.count = 0

    @classmethod
    def install(cls, head, mode: str, chunk: int) -> FusedHead:
        fused = cls(head, mode, chunk)
        head.forward = fused.forward
        return fused

    def run(self, model, ids, positions, labels, per_token: bool = False):
        """``model``'s forward with this head computing the loss of ``labels`` (the sum, or each trained
        position's); raises if the forward never called the head."""
        self.expect(labels, per_token)
        try:
            out = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        finally:
            missed, self.labels = self.labels is not None, None
        if missed:
            raise RuntimeError("the fused loss's head was not called by the model's forward")
        return out

    def expect(self, labels, per_token: bool = False) -> None:
        """The labels of the next forward; ``per_token``: return each trained position's cross-entropy (a vector,
        for preference pairs' log-probabilities) instead of their sum."""
        self.labels, self.per_token = labels, per_token

    def forward(self, hidden, *args: Any, **kwargs: Any):
        labels, self.labels = self.labels, None
        if labels is None:
            return self.original(hidden, *args, **kwargs)
        return self.loss(hidden, labels, self.per_token)

    def loss(self, hidden, labels, per_token: bool = False):
        """Summed next-token cross-entropy (float32) of the positions ``labels`` trains; ``per_token``: each
        position's, in row-major order (always chunked: Liger's kernel sums)."""
        import torch
        from torch.utils.checkpoint import checkpoint

        from ladle.data.packing import IGNORE

        targets = labels[:, 1:].reshape(-1)
        states = hidden[:, : labels.size(1) - 1].reshape(-1, hidden.size(-1))
        keep = (targets != IGNORE).nonzero().squeeze(1)
        self.count = int(keep.numel())
        states, targets = states.index_select(0, keep), targets.index_select(0, keep)
        if self.count == 0:  # still part of the graph, so backward runs as it would with trained tokens
            zero = hidden.sum().float() * 0.0
            return zero.reshape(1)[:0] if per_token else zero
        if per_token:
            pieces = [
                checkpoint(
                    _chunk_losses,
                    self.original,
                    states[start : start + self.chunk],
                    targets[start : start + self.chunk],
                    use_reentrant=False,
                )
                for start in range(0, self.count, self.chunk)
            ]
            return torch.cat(pieces)
        if self.mode == "liger":
            from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

            fn = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE, reduction="sum")
            return fn(self.head.weight, states, targets, self.head.bias).float()
        total = None
        for start in range(0, self.count, self.chunk):
            piece = checkpoint(
                _chunk_loss,
                self.original,
                states[start : start + self.chunk],
                targets[start : start + self.chunk],
                use_reentrant=False,
            )
            total = piece if total is None else total + piece
        assert total is not None and total.dtype == torch.float32
        return total


def _chunk_loss(head_forward, states, targets):
    import torch.nn.functional as F

    return F.cross_entropy(head_forward(states).float(), targets, reduction="sum")


def _chunk_losses(head_forward, states, targets):
    import torch.nn.functional as F

    return F.cross_entropy(head_forward(states).float(), targets, reduction="none")
