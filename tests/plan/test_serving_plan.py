"""What the planner decides about serving before anything trains: whether DeepSpeed-MII (FastGen) can serve the
model in the run's dtype, the KV budget it sizes, and the CUDA arch list DeepSpeed's op builds get."""

from __future__ import annotations

import pytest

from ladle.config import build_config
from ladle.errors import ConfigError
from ladle.machine import cuda_arch
from ladle.machine.topology import probe
from ladle.plan.planner import make_plan
from tests.helpers import A100_X8

MINIMAL = {"base": "ladle://tiny-llama", "data": {"path": "ladle://demo-alpaca"}}
A100 = probe(env={}, query_output=A100_X8)
LLAMA_1B = {
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "head_dim": 64,
}


def fastgen_problems(model: dict, *overrides: str) -> list[str]:
    """The plan's FastGen problems for ``model`` served by MII on 8 A100s (the mii package's absence aside)."""
    cfg = build_config(MINIMAL, ["serve.backend=mii", *overrides])
    try:
        make_plan(cfg, A100, model=model)
    except ConfigError as err:
        return [p for p in err.problems if "FastGen" in p]
    return []


def test_a_model_fastgen_can_serve_plans_clean():
    assert fastgen_problems(LLAMA_1B) == []


@pytest.mark.parametrize(
    "change, overrides, message",
    [
        ({"model_type": "gemma"}, [], "cannot serve model_type 'gemma'; the installed DeepSpeed implements"),
        ({"head_dim": 32}, [], "head sizes 64, 80, 96, 128 and this model's is 32"),
        ({}, ["training.dtype=float32"], "fp16/bf16 weights only and the merged model would be float32"),
    ],
)
def test_what_fastgen_cannot_serve_is_refused_at_plan_time(change, overrides, message):
    problems = fastgen_problems({**LLAMA_1B, **change}, *overrides)
    assert len(problems) == 1 and message in problems[0], problems
    fix = "training.dtype=bfloat16" if overrides else "Use serve.backend=transformers."
    assert problems[0].startswith("serve.backend = mii:") and fix in problems[0]


def test_the_plan_sizes_serving_by_the_kv_budget():
    cfg = build_config(MINIMAL, ["serve.max_batch_size=4", "serve.max_new_tokens=64", "data.seq_len=256"])
    assert cfg.serving().kv_cache_tokens == 4 * (256 + 64) and cfg.serve.kv_cache_tokens == 0
    plan = make_plan(cfg, A100, model=LLAMA_1B)
    assert any("KV cache of 1280 tokens: serve.kv_cache_tokens, 4 request(s) x 320" in r for r in plan.reasons)
    # The largest prefill (every row's prompt at once) is counted beside the cache: one layer's hidden states and
    # MLP rows; its logits are one row per request, as a decode step's.
    from ladle import sizing

    shape = sizing.ModelShape(
        params=10**9, trainable=0, layers=16, hidden=2048, intermediate=8192, kv_dim=512, heads=32, vocab=128256,
        embedding_params=0, layer_params=0,
    )  # fmt: skip
    bare = shape.params * 2 + sizing.kv_bytes(16, 512, 1280, 2) + 4 * 128256 * 4
    assert sizing.serve_bytes(shape, 2, 4, 320) - bare == 1280 * (4 * 2048 + 3 * 8192) * 2
    assert any("a prefill of that many prompt tokens at once" in r for r in plan.reasons)
    explicit = build_config(MINIMAL, ["serve.kv_cache_tokens=9000"])
    assert explicit.serving().kv_cache_tokens == 9000


def test_an_arch_list_deepspeed_cannot_parse_is_rewritten_and_said(monkeypatch):
    assert cuda_arch.parseable("8.0 8.6 9.0a+PTX") == "8.0;8.6;9.0+PTX"
    assert cuda_arch.parseable("10.0f;12.0a") == "10.0;12.0"
    assert cuda_arch.fixed_env({"TORCH_CUDA_ARCH_LIST": "8.0 8.6"}) == ({"TORCH_CUDA_ARCH_LIST": "8.0 8.6"}, None)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    plan = make_plan(build_config(MINIMAL, []), A100, model=LLAMA_1B)
    assert any(r.startswith("TORCH_CUDA_ARCH_LIST = 9.0a:") and "get 9.0" in r for r in plan.reasons)

    from ladle.train.run import worker_env
    from tests.helpers import strategy_spec

    assert worker_env(strategy_spec("ddp", __import__("pathlib").Path("/tmp")))["TORCH_CUDA_ARCH_LIST"] == "9.0"


def test_a_model_larger_than_one_gpu_is_spread_over_all_of_them():
    from ladle.sizing import spread_over

    gib = 2**30
    assert spread_over(141 * gib, gib, 8, 80 * gib) == 8  # 70B in bf16: every GPU
    assert spread_over(16 * gib, gib, 8, 80 * gib) == 1  # 8B: one GPU is enough
    assert spread_over(65 * gib, 30 * gib, 8, 80 * gib) == 8  # 32B with a large KV cache: spread too
    assert spread_over(141 * gib, gib, 1, 80 * gib) == 1  # one GPU: nothing to spread over (the plan warns)
    assert spread_over(141 * gib, gib, 0, None) == 1  # CPU
    plan = make_plan(build_config(MINIMAL, []), A100, model=LLAMA_1B)
    assert any(r.startswith("evaluate:") and "over one device" in r for r in plan.reasons)
