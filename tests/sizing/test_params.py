"""Parameter counts from config.json match what the Hugging Face class instantiates (checked on the meta device)."""

from __future__ import annotations

import pytest

from ladle.sizing.params import FAMILIES, count_params, lora_params, meta_count, trains_ends
from tests.helpers import LLAMA3_8B, MISTRAL_7B, QWEN2_7B

SMALL = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
EXTRA = {
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [1],
    },
    "qwen3_moe": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [0],
    },
    "deepseek_v3": {
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "q_lora_rank": 24,
        "kv_lora_rank": 16,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8,
        "v_head_dim": 8,
        "n_group": 2,
        "topk_group": 1,
    },
    "gemma2": {"head_dim": 16},
    "llama": {"tie_word_embeddings": True, "attention_bias": True},
    "qwen3": {"head_dim": 24},
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_formula_matches_meta_instantiation(family):
    config = {"model_type": family, **SMALL, **EXTRA.get(family, {})}
    counted, how = count_params(config)
    assert how == "formula"
    assert counted == meta_count(config)


@pytest.mark.parametrize(
    "config, published", [(LLAMA3_8B, 8_030_261_248), (QWEN2_7B, 7_615_616_512), (MISTRAL_7B, 7_241_732_096)]
)
def test_real_configs(config, published):
    counted, _ = count_params(config)
    assert counted == published == meta_count(config)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma2", "phi3", "deepseek_v3", "mixtral"])
@pytest.mark.parametrize(
    ("targets", "saved"),
    [
        (["q_proj", "v_proj"], []),
        ("all-linear", []),
        (["o_proj", "down_proj", "qkv_proj", "kv_b_proj"], []),
        # peft trains a full copy of each: the head (tied to the embedding in some families) and the embedding
        (["q_proj", "v_proj"], ["lm_head"]),
        ("all-linear", ["lm_head", "embed_tokens"]),
        (["q_proj"], ["model.norm"]),
        (["q_proj"], ["norm"]),  # every module whose name ends with it: the layers' norms too
    ],
)
def test_lora_counts_match_peft(family, targets, saved):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    config = {"model_type": family, **SMALL, **EXTRA.get(family, {})}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    wanted = targets if targets == "all-linear" else [t for t in targets if t in names]
    if not wanted:
        pytest.skip(f"{family} has none of {targets}")
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=wanted, modules_to_save=saved or None))
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    assert lora_params(config, 4, wanted, saved) == trainable
    trains = any(n.endswith(("lm_head", "embed_tokens")) for n in saved)
    assert trains_ends(config, saved) is trains
