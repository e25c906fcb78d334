"""Attention example by example in packed rows (``training.kernels.packed_attention``): the same loss and
gradients as transformers' masked SDPA over whole rows, for the models it is for, and a clear refusal elsewhere."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ladle.plan import kernels as plan_kernels
from ladle.train import packed_attention
from ladle.train.packed_attention import Layout
from ladle.train.padding_free import JoinRows
from tests.train.test_kernels import cfg_with, close, tiny
from tests.train.test_padding_free import decoder, loss_and_grads, packed


def test_layout_regroups_examples_and_puts_every_token_back():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2], [0, 1, 2, 3, 4, 5, 0, 1]])
    layout = Layout(positions)
    assert (layout.examples, layout.longest) == (5, 6)
    x = torch.randn(2, 3, 8, 4)  # rows, heads, length, dim
    grouped = layout.regroup(x)
    assert grouped.shape == (5, 3, 6, 4)
    assert torch.equal(grouped[1, :, :2], x[0, :, 3:5])  # the second example of the first row, from slot 0
    assert torch.equal(grouped[3, :, :6], x[1, :, :6])
    back = layout.restore(grouped, 2, 8)
    assert torch.equal(back, x.transpose(1, 2))  # every token from its own slot
    assert packed_attention.layout_of(positions) is packed_attention.layout_of(positions)  # once per forward


@pytest.mark.parametrize("joined", [False, True], ids=["rows", "joined rows"])
@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_attention_by_example_trains_as_masked_sdpa(lora, joined):
    model = tiny(lora)
    data = packed(model.config.vocab_size)
    rows = list(range(len(data["input_ids"])))
    from ladle.train import run_state

    run_state.on(model).joiner = JoinRows(1.0, 0.0) if joined else None
    plain, plain_count, plain_grads = loss_and_grads(model, data, rows)
    assert model.config._attn_implementation == "sdpa"
    assert packed_attention.install(model, {"packed_attention": "auto"}) == "on: causal SDPA per example"
    assert model.config._attn_implementation == "ladle_packed"
    loss, count, grads = loss_and_grads(model, data, rows)
    assert count == plain_count > 0
    assert loss.item() == pytest.approx(plain.item(), rel=1e-5)
    assert grads.keys() == plain_grads.keys() and grads
    for name, grad in grads.items():
        assert close(grad, plain_grads[name], 1e-4), name


def test_without_position_ids_or_with_a_mask_it_is_transformers_sdpa():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = SimpleNamespace(is_causal=True, num_key_value_groups=2, training=False)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 10, 8, generator=g) for h in (4, 2, 2))
    expected, _ = sdpa_attention_forward(module, q, k, v, None)
    out, _ = packed_attention.attention(module, q, k, v, None)
    assert torch.allclose(out, expected)
    one_example = torch.arange(10).repeat(2, 1)  # one example per row: causal attention over the row
    out, _ = packed_attention.attention(module, q, k, v, None, position_ids=one_example)
    assert torch.allclose(out, expected, atol=1e-6)


def test_models_whose_attention_is_not_plain_are_said_and_refused_when_asked_for():
    llama = SimpleNamespace(model_type="llama")
    assert packed_attention.unsupported(llama) is None
    qwen2 = SimpleNamespace(model_type="qwen2", sliding_window=4096, use_sliding_window=False)
    assert packed_attention.unsupported(qwen2) is None
    mistral = SimpleNamespace(model_type="mistral", sliding_window=4096)
    assert packed_attention.unsupported(mistral) == "mistral uses sliding-window attention"
    capped = SimpleNamespace(model_type="gemma", attn_logit_softcapping=50.0)
    assert packed_attention.unsupported(capped) == "gemma soft-caps its attention logits"
    gpt2 = SimpleNamespace(model_type="gpt2")
    assert packed_attention.unsupported(gpt2) == "gpt2's attention has not been checked with it"
    model = SimpleNamespace(config=mistral)
    assert packed_attention.install(model, {"packed_attention": "auto"}) == "off: mistral uses sliding-window attention"
    with pytest.raises(RuntimeError, match=r"packed_attention = true: mistral uses sliding-window attention\. Set"):
        packed_attention.install(model, {"packed_attention": "on"})
    assert packed_attention.install(model, {"packed_attention": "off"}) == "off"


def test_plan_decides_attention_by_example_and_joining_follows_it():
    auto = cfg_with().training.kernels
    decided, why = plan_kernels.decide(auto, "ddp", "cpu", "float32")
    assert decided["packed_attention"] == "auto"
    assert "attention example by example on where the model's attention is plain causal attention" in why[0]
    decided, why = plan_kernels.decide(auto, "ddp", "cuda", "bfloat16")
    assert decided["packed_attention"] == "auto" and "example by example on where" in why[0]
    decided, why = plan_kernels.decide(auto, "pipeline", "cpu", "float32")
    assert decided["packed_attention"] == "off" and "pipeline keeps its own attention masks" in why[0]
    forced = cfg_with("training.kernels.packed_attention=true").training.kernels
    assert plan_kernels.decide(forced, "ddp", "cuda", "bfloat16")[0]["packed_attention"] == "on"
    assert "packed_attention = true with parallelism.strategy = tp" in plan_kernels.problems(forced, "tp", "cpu")[0]
    # Attention per example: joining adds no pair, so any padding is worth dropping; masked SDPA: priced.
    shape = decoder(hidden=128, heads=4, kv_heads=2, inner=352)
    nearly_full = [250, 244, 251, 240]
    assert not JoinRows.for_config(shape).worth(nearly_full, 256)
    assert JoinRows.for_config(shape, by_example=True).worth(nearly_full, 256)
    assert not JoinRows.for_config(shape, by_example=True).worth([256, 256], 256)
