"""The fused LoRA layer (``ladle.train.lora_fused``) computes what peft's layer computes, forward and backward, by
either of its ways, and leaves every other call to peft."""

from __future__ import annotations

import pytest
import torch

from ladle.train import lora_fused


def lora_layer(fan_in: int, fan_out: int, r: int = 4, bias: bool = False, dropout: float = 0.0):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(fan_in, fan_out, bias=bias))
    model = get_peft_model(net, LoraConfig(r=r, lora_alpha=2 * r, target_modules=["0"], lora_dropout=dropout))
    layer = model.base_model.model[0]
    torch.nn.init.normal_(layer.lora_B["default"].weight, std=0.1)  # peft starts B at zero: make the branch count
    return model, layer


def forward_backward(model, layer, x):
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    out = model(x)
    (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    return out.detach(), x.grad, layer.lora_A["default"].weight.grad, layer.lora_B["default"].weight.grad


@pytest.fixture
def calls(monkeypatch) -> list:
    """Which of the fused functions ran, in order (each still computes)."""
    seen: list = []
    for fn in (lora_fused.Merged, lora_fused.Factored):
        original = fn.apply
        monkeypatch.setattr(fn, "apply", lambda *a, _f=fn, _o=original: seen.append(_f) or _o(*a))
    return seen


@pytest.mark.parametrize(
    ("tokens", "fan_in", "fan_out", "bias", "way"),
    [
        (64, 16, 24, False, lora_fused.Merged),
        (3, 16, 24, True, lora_fused.Factored),
        (40, 24, 8, True, lora_fused.Merged),
    ],
)
def test_both_ways_equal_peft_forward_and_backward(calls, tokens, fan_in, fan_out, bias, way):
    model, layer = lora_layer(fan_in, fan_out, bias=bias)
    x = torch.randn(2, tokens // 2 if tokens > 3 else tokens, fan_in)
    n = x.numel() // fan_in
    assert lora_fused.merges(n, fan_in, fan_out) == (way is lora_fused.Merged)
    expected = forward_backward(model, layer, x)
    assert lora_fused.install(model) == 1 and type(layer).__name__ == "FusedLinear"
    got = forward_backward(model, layer, x)
    assert calls == [way]
    for e, g, what in zip(expected, got, ("output", "input grad", "A grad", "B grad"), strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6, msg=what)
    assert layer.base_layer.weight.grad is None  # the frozen base gets no gradient


def test_other_calls_run_peft_own_forward(calls):
    """Dropout, disabled adapters and a base bias that trains leave the call to peft's own forward."""
    x = torch.randn(4, 8)
    dropped, _ = lora_layer(8, 8, dropout=0.5)
    lora_fused.install(dropped)
    dropped(x)
    model, layer = lora_layer(8, 8, bias=True)
    assert lora_fused.install(model) == 1
    with model.disable_adapter():
        torch.testing.assert_close(model(x), layer.base_layer(x))
    layer.base_layer.bias.requires_grad_(True)
    model(x)
    assert calls == []
    layer.base_layer.bias.requires_grad_(False)
    model(x)
    assert calls == [lora_fused.Factored]  # 4 tokens x (8 + 8) < 2 x 8 x 8: the three products


@pytest.mark.parametrize("tokens", [64, 3])
def test_under_autocast_the_fused_path_runs_and_equals_peft(calls, tokens):
    """Mixed precision (autocast; a GPU run's bf16, here on the CPU) takes the fused path: every operand cast to
    autocast's dtype as autocast casts a linear layer's; it went to peft's path before while reported on."""
    model, layer = lora_layer(16, 24, bias=True)
    x = torch.randn(1, tokens, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = forward_backward(model, layer, x)
    lora_fused.install(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = forward_backward(model, layer, x)
    assert calls == [lora_fused.Merged if lora_fused.merges(tokens, 16, 24) else lora_fused.Factored]
    assert got[0].dtype == expected[0].dtype == torch.bfloat16
    assert got[2].dtype == torch.float32  # the adapter's gradient reaches its float32 weight
    for e, g, what in zip(expected, got, ("output", "input grad", "A grad", "B grad"), strict=True):
        # bf16 keeps 8 bits of mantissa: both sides round each product to it, in another order
        torch.testing.assert_close(g.float(), e.float(), rtol=2e-2, atol=2e-2 * float(e.abs().max()), msg=what)
