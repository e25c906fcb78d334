"""Parameter counts from a model's ``config.json``, offline and without torch.

Each supported family is described as the tensors its Hugging Face model class
instantiates (parameters, not buffers): ``nn.Linear`` layers, which LoRA can
target by name, and other weights (embeddings, norms, fused MoE experts,
routers). Totals and LoRA counts both derive from that one description, so
they cannot disagree. Other architectures fall back to instantiating the model
on the meta device (needs torch and transformers; no memory is allocated).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ladle.errors import LadleError


@dataclass(frozen=True)
class Linear:
    name: str  # module name, the last dotted component (what peft's target_modules match)
    fan_in: int
    fan_out: int
    count: int  # how many such modules in the model
    bias: bool = False

    @property
    def params(self) -> int:
        return self.count * (self.fan_in * self.fan_out + (self.fan_out if self.bias else 0))


@dataclass(frozen=True)
class Weight:
    name: str
    numel: int
    count: int = 1

    @property
    def params(self) -> int:
        return self.count * self.numel


@dataclass(frozen=True)
class Experts:
    """Fused expert weights, one (experts, fan_out, fan_in) parameter per layer.

    ``pair`` marks gate_up_proj, which holds two projections side by side.
    """

    name: str
    experts: int
    fan_in: int
    fan_out: int
    count: int
    pair: bool = False

    @property
    def params(self) -> int:
        return self.count * self.experts * self.fan_in * self.fan_out


Layout = list[Linear | Weight | Experts]


def _head_dim(c: dict) -> int:
    return c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]


def _embeddings(c: dict) -> Layout:
    h, v = c["hidden_size"], c["vocab_size"]
    out: Layout = [Weight("embed_tokens", v * h), Weight("norm", h)]
    if not c.get("tie_word_embeddings", False):
        out.append(Linear("lm_head", h, v, 1))
    return out


def _attention(c: dict, layers: int, bias: bool, qk_norm: bool = False) -> Layout:
    h, hd = c["hidden_size"], _head_dim(c)
    nh, nkv = c["num_attention_heads"], c.get("num_key_value_heads") or c["num_attention_heads"]
    out: Layout = [
        Linear("q_proj", h, nh * hd, layers, bias),
        Linear("k_proj", h, nkv * hd, layers, bias),
        Linear("v_proj", h, nkv * hd, layers, bias),
        Linear("o_proj", nh * hd, h, layers, c.get("attention_bias", False) and bias),
    ]
    if qk_norm:
        out += [Weight("q_norm", hd, layers), Weight("k_norm", hd, layers)]
    return out


def _mlp(h: int, inter: int, layers: int) -> Layout:
    return [
        Linear("gate_proj", h, inter, layers),
        Linear("up_proj", h, inter, layers),
        Linear("down_proj", inter, h, layers),
    ]


def _experts(h: int, inter: int, experts: int, layers: int) -> Layout:
    """Fused expert weights (gate_up_proj and down_proj parameters) and the router (a bias-free H -> E map)."""
    return [
        Experts("gate_up_proj", experts, h, 2 * inter, layers, pair=True),
        Experts("down_proj", experts, inter, h, layers),
        Linear("gate", h, experts, layers),
    ]


def dense(c: dict, qkv_bias: bool = False, qk_norm: bool = False) -> Layout:
    """Llama, Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k norms)."""
    n, h = c["num_hidden_layers"], c["hidden_size"]
    bias = qkv_bias or c.get("attention_bias", False)
    return [
        *_embeddings(c),
        *_attention(c, n, bias, qk_norm),
        *_mlp(h, c["intermediate_size"], n),
        Weight("layernorms", 2 * h, n),
    ]


def mixtral(c: dict) -> Layout:
    n, h = c["num_hidden_layers"], c["hidden_size"]
    return [
        *_embeddings(c),
        *_attention(c, n, False),
        *_experts(h, c["intermediate_size"], c["num_local_experts"], n),
        Weight("layernorms", 2 * h, n),
    ]


def qwen_moe(c: dict, qkv_bias: bool, qk_norm: bool) -> Layout:
    """Qwen2-MoE (shared expert + gate, q/k/v bias) and Qwen3-MoE (q/k norms); dense layers where configured."""
    n, h = c["num_hidden_layers"], c["hidden_size"]
    step, dense_only = c.get("decoder_sparse_step", 1), set(c.get("mlp_only_layers") or [])
    sparse = sum(1 for i in range(n) if i not in dense_only and c.get("num_experts", 0) > 0 and (i + 1) % step == 0)
    out = [*_embeddings(c), *_attention(c, n, qkv_bias, qk_norm), Weight("layernorms", 2 * h, n)]
    out += _experts(h, c["moe_intermediate_size"], c["num_experts"], sparse) + _mlp(
        h, c["intermediate_size"], n - sparse
    )
    if c.get("shared_expert_intermediate_size"):
        out += [
            Linear("gate_proj", h, c["shared_expert_intermediate_size"], sparse),
            Linear("up_proj", h, c["shared_expert_intermediate_size"], sparse),
            Linear("down_proj", c["shared_expert_intermediate_size"], h, sparse),
            Linear("shared_expert_gate", h, 1, sparse),
        ]
    return out


def gemma2(c: dict) -> Layout:
    n, h = c["num_hidden_layers"], c["hidden_size"]
    return [
        *_embeddings({**c, "tie_word_embeddings": c.get("tie_word_embeddings", True)}),
        *_attention(c, n, c.get("attention_bias", False)),
        *_mlp(h, c["intermediate_size"], n),
        Weight("layernorms", 4 * h, n),
    ]


def phi3(c: dict) -> Layout:
    n, h, hd = c["num_hidden_layers"], c["hidden_size"], _head_dim(c)
    nh, nkv, inter = (
        c["num_attention_heads"],
        c.get("num_key_value_heads") or c["num_attention_heads"],
        c["intermediate_size"],
    )
    return [
        *_embeddings(c),
        Linear("qkv_proj", h, (nh + 2 * nkv) * hd, n),
        Linear("o_proj", nh * hd, h, n),
        Linear("gate_up_proj", h, 2 * inter, n),
        Linear("down_proj", inter, h, n),
        Weight("layernorms", 2 * h, n),
    ]


def deepseek_v3(c: dict) -> Layout:
    """Multi-head latent attention; MoE after ``first_k_dense_replace`` dense layers; the MTP layer is not instantiated."""
    n, h, nh = c["num_hidden_layers"], c["hidden_size"], c["num_attention_heads"]
    rope, nope, vdim, kv_rank = c["qk_rope_head_dim"], c["qk_nope_head_dim"], c["v_head_dim"], c["kv_lora_rank"]
    q_rank, dense_n = c.get("q_lora_rank"), min(c.get("first_k_dense_replace", 0), n)
    attn: Layout = [
        Linear("kv_a_proj_with_mqa", h, kv_rank + rope, n, c.get("attention_bias", False)),
        Weight("kv_a_layernorm", kv_rank, n),
        Linear("kv_b_proj", kv_rank, nh * (nope + vdim), n),
        Linear("o_proj", nh * vdim, h, n, c.get("attention_bias", False)),
    ]
    if q_rank:
        attn += [
            Linear("q_a_proj", h, q_rank, n, c.get("attention_bias", False)),
            Weight("q_a_layernorm", q_rank, n),
            Linear("q_b_proj", q_rank, nh * (nope + rope), n),
        ]
    else:
        attn += [Linear("q_proj", h, nh * (nope + rope), n)]
    moe_n, shared = n - dense_n, c.get("n_shared_experts") or 0
    out = [*_embeddings(c), *attn, Weight("layernorms", 2 * h, n), *_mlp(h, c["intermediate_size"], dense_n)]
    out += _experts(h, c["moe_intermediate_size"], c["n_routed_experts"], moe_n)
    if shared:
        out += _mlp(h, c["moe_intermediate_size"] * shared, moe_n)
    return out


FAMILIES: dict[str, Callable[[dict], Layout]] = {
    "llama": dense,
    "mistral": dense,
    "qwen2": lambda c: dense(c, qkv_bias=True),
    "qwen3": lambda c: dense(c, qk_norm=True),
    "mixtral": mixtral,
    "qwen2_moe": lambda c: qwen_moe(c, qkv_bias=True, qk_norm=False),
    "qwen3_moe": lambda c: qwen_moe(c, qkv_bias=False, qk_norm=True),
    "gemma2": gemma2,
    "phi3": phi3,
    "deepseek_v3": deepseek_v3,
}


def read_config(path: str | Path) -> dict:
    """A ``config.json`` (or the folder holding one) as a dict.

    Raises:
        LadleError: missing or not JSON.
    """
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise LadleError(
            f"--model-config = {str(path)!r}: no config.json there. Pass a model folder or its config.json."
        ) from None
    except json.JSONDecodeError as exc:
        raise LadleError(f"--model-config = {str(path)!r}: not valid JSON ({exc.msg}).") from None


def layout(config: dict) -> Layout | None:
    """The tensors of a known family, or None for other architectures."""
    family = FAMILIES.get(config.get("model_type", ""))
    return family(config) if family else None


def count_params(config: dict) -> tuple[int, str]:
    """Total parameters and how they were counted (``formula`` or ``meta-device``)."""
    parts = layout(config)
    if parts is not None:
        return sum(p.params for p in parts), "formula"
    return meta_count(config), "meta-device"


def lora_params(config: dict, r: int, target_modules: list[str] | str, modules_to_save: list[str] = ()) -> int:
    """Trainable parameters of a LoRA run as peft builds them: the adapters on ``target_modules`` (name suffix
    match, or 'all-linear' minus the head), plus the trained copy peft makes of each ``modules_to_save`` module
    (an embedding or head copy can outweigh every adapter: Llama-3's head is 525M parameters)."""
    parts = layout(config)
    if parts is None:
        raise LadleError(
            f"model_type = {config.get('model_type')!r}: LoRA counting needs a known family ({', '.join(FAMILIES)})."
        )
    saved = saved_parts(parts, modules_to_save)
    if saved is None or any(isinstance(p, Experts) for p in parts):
        # peft wraps fused expert parameters too (all-linear, and names that collide with them) by rules of its
        # own, and matches modules_to_save against full module names; where the layout cannot say which modules
        # those are, ask peft itself rather than mirror its rules.
        return meta_lora_count(config, r, target_modules, modules_to_save)
    linears = [p for p in parts if isinstance(p, Linear)]
    if target_modules == "all-linear":
        chosen = [p for p in linears if p.name != "lm_head"]
    else:
        chosen = [p for p in linears if p.name in set(target_modules)]
    return sum(p.count * r * (p.fan_in + p.fan_out) for p in chosen) + sum(p.params for p in saved)


def lora_base_params(config: dict, target_modules: list[str] | str) -> int | None:
    """Weights of the linear layers LoRA adapts (``target_modules`` as ``lora_params`` matches them): what a copy
    of them with their adapters merged holds. None where the layout cannot say (an unknown family, experts)."""
    parts = layout(config)
    if parts is None or any(isinstance(p, Experts) for p in parts):
        return None
    linears = [p for p in parts if isinstance(p, Linear)]
    chosen = [
        p for p in linears if (p.name != "lm_head" if target_modules == "all-linear" else p.name in set(target_modules))
    ]
    return sum(p.count * p.fan_in * p.fan_out for p in chosen)


ENDS = ("embed_tokens", "lm_head")
END_KEYS = ("model.embed_tokens", "lm_head")  # their full names in every family the layout knows


def saved_parts(parts: Layout, modules_to_save: list[str]) -> list | None:
    """The layout's parts that ``modules_to_save`` names, or None when the layout cannot say. Only the ends are
    read from the layout: peft matches every module whose full name ends with an entry (``norm`` is every
    layer's norms too), and a tied head is no part of its own; anything else is counted by peft itself."""
    out: list = []
    for entry in modules_to_save:
        name = entry.rsplit(".", 1)[-1]
        matched = [p for p in parts if p.name == name]
        if name not in ENDS or not matched:
            return None
        out += [p for p in matched if p not in out]
    return out


def trains_ends(config: dict, modules_to_save: list[str]) -> bool:
    """Whether ``modules_to_save`` trains the input embedding or the output head, matched as peft matches (a
    module whose full name ends with an entry). True for a family the layout does not know, whose ends may be
    named otherwise: a sharded strategy then sizes both ends as gathered, the larger figure."""
    if not modules_to_save:
        return False
    if layout(config) is None:
        return True
    return any(key.endswith(entry) for key in END_KEYS for entry in modules_to_save)


def meta_count(config: dict) -> int:
    """Instantiate on the meta device and count (any architecture transformers knows)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in model.parameters())


def meta_lora_count(config: dict, r: int, target_modules: list[str] | str, modules_to_save: list[str] = ()) -> int:
    """LoRA trainable parameters (adapters and ``modules_to_save`` copies) as peft builds them, on a meta-device
    model."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    lora = LoraConfig(r=r, target_modules=target_modules, modules_to_save=list(modules_to_save) or None)
    # The adapters on the meta device too: outside it peft makes and initialises each one in host memory before
    # moving it to its base layer's device (2 s of random init for DeepSeek-V3's 1,525 adapted layers, and their
    # memory, to count them).
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
        peft_model = get_peft_model(model, lora)
    return sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
