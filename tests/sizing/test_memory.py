"""Model-state memory agrees with DeepSpeed's own estimators (within 1 %), over real model sizes and GPU counts."""

from __future__ import annotations

import os

import pytest

from ladle.sizing import memory
from ladle.sizing.params import count_params
from tests.helpers import LLAMA3_8B, MISTRAL_7B, QWEN2_7B

os.environ.setdefault("DS_ACCELERATOR", "cpu")
MODELS = [
    LLAMA3_8B,
    QWEN2_7B,
    MISTRAL_7B,
    {**LLAMA3_8B, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64},
]  # the last is Llama-3-70B's shape
LAYOUTS = [(1, 1), (8, 1), (4, 2), (8, 4)]


def largest_layer(config: dict) -> int:
    return config["vocab_size"] * config["hidden_size"]  # embedding / head: the largest single module


@pytest.mark.parametrize("config", MODELS, ids=["llama3-8b", "qwen2-7b", "mistral-7b", "llama3-70b"])
@pytest.mark.parametrize("gpus, nodes", LAYOUTS)
@pytest.mark.parametrize("offload", [False, True])
def test_zero2_matches_deepspeed(config, gpus, nodes, offload):
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    params, _ = count_params(config)
    ds_host, ds_device = estimate_zero2_model_states_mem_needs(params, gpus, nodes, cpu_offload=offload)
    ours = memory.zero2(params, gpus, nodes, offload_optimizer=offload)
    assert ours.device == pytest.approx(ds_device, rel=0.01)
    assert ours.host == pytest.approx(ds_host, rel=0.01)


@pytest.mark.parametrize("config", MODELS, ids=["llama3-8b", "qwen2-7b", "mistral-7b", "llama3-70b"])
@pytest.mark.parametrize("gpus, nodes", LAYOUTS)
@pytest.mark.parametrize("offload_optimizer, offload_params", [(False, False), (True, False), (True, True)])
def test_zero3_matches_deepspeed(config, gpus, nodes, offload_optimizer, offload_params):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    params, _ = count_params(config)
    ds_host, ds_device, _ = estimate_zero3_model_states_mem_needs(
        params, largest_layer(config), gpus, nodes, cpu_offload=offload_optimizer, cpu_offload_params=offload_params
    )
    ours = memory.zero3(params, largest_layer(config), gpus, nodes, offload_optimizer, offload_params)
    assert ours.device == pytest.approx(ds_device, rel=0.01)
    assert ours.host == pytest.approx(ds_host, rel=0.01)


def test_sharding_order_and_lora():
    params = count_params(LLAMA3_8B)[0]
    full, z1, z2 = memory.ddp(params).device, memory.zero1(params, 8).device, memory.zero2(params, 8).device
    z3 = memory.zero3(params, largest_layer(LLAMA3_8B), 8).device
    assert full > z1 > z2 > z3
    assert full == 20 * params  # 2 + 2 + 16 bytes per parameter
    adapters = memory.lora(params, 3_407_872)
    assert adapters.weights == 2 * params + 2 * 3_407_872 and adapters.optimizer == 16 * 3_407_872
    assert memory.lora(params, 3_407_872, ranks=8, shard_base=True).weights < adapters.weights
