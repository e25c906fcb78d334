"""Each plain LoRA layer's forward and backward as one autograd function (``training.kernels.lora_fused``).

peft computes an adapted layer as three products and two elementwise passes, each a node of autograd's graph:
``W x``, ``A x``, ``B (A x)``, the scale, the sum; the backward runs five more products, the scale again and a
sum of the two input gradients. Here one function does the same work, choosing per call by its token count ``N``
(the layer's input and output widths ``i`` and ``o``, rank ``r``):

- **merged**, where ``N (i + o) > 2 i o`` (``N`` above the widths' harmonic mean): the forward is one product
  with ``W + s B A``, a matrix made for the call and freed. That costs ``r i o`` to make, made again for the
  backward's input gradient, and saves the two thin products ``N r (i + o)``. Only the input is kept for the
  backward (peft keeps it and ``A x``).
- **factored**, otherwise: peft's three products, the scale folded into one fused multiply-add, and the backward
  written out (``g B`` once, for both the input's and ``A``'s gradients).

The gradients are the same sums (float32 rounding apart: ``tests/train/test_lora_fused.py`` holds both ways to
peft's forward and backward). It runs where one adapter is active on a plain ``nn.Linear`` base, without dropout
or a variant (DoRA), with the input, the weight and the adapters in one dtype and a base bias that does not
train; any other call runs peft's own forward. The rollouts' merged sampling (``grpo.merged_adapters``) and
peft's ``disable_adapter`` apply as before.

It reads each weight at call time, so FSDP2's unsharded parameters (set on the modules for a unit's forward) are
what it computes with; DeepSpeed's ZeRO-3 gathers a module's weights when that module is called, and this
function calls no submodule, so the plan keeps it off there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class Merged(torch.autograd.Function):
    """``x (W + s B A)^T + bias``; gradients for the input and the adapters."""

    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scale: float):
        ctx.save_for_backward(x, weight, lora_a, lora_b)
        ctx.scale = scale
        return F.linear(x, torch.addmm(weight, lora_b, lora_a, alpha=scale), bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight, lora_a, lora_b = ctx.saved_tensors
        scale = ctx.scale
        x2, g2 = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = (g2 @ torch.addmm(weight, lora_b, lora_a, alpha=scale)).view(x.shape)
        gb = g2 @ lora_b  # [N, r]
        grad_a = (gb.t() @ x2).mul_(scale)
        grad_b = (g2.t() @ (x2 @ lora_a.t())).mul_(scale)
        return grad_x, None, None, grad_a, grad_b, None


class Factored(torch.autograd.Function):
    """``x W^T + bias + s (x A^T) B^T``, the scale and the sum in one fused multiply-add."""

    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scale: float):
        x2 = x.reshape(-1, x.shape[-1])
        xa = x2 @ lora_a.t()
        out = torch.addmm(F.linear(x2, weight, bias), xa, lora_b.t(), alpha=scale)
        ctx.save_for_backward(x, xa, weight, lora_a, lora_b)
        ctx.scale = scale
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x, xa, weight, lora_a, lora_b = ctx.saved_tensors
        scale = ctx.scale
        x2, g2 = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
        gb = g2 @ lora_b  # [N, r]
        grad_x = torch.addmm(g2 @ weight, gb, lora_a, alpha=scale).view(x.shape) if ctx.needs_input_grad[0] else None
        grad_a = (gb.t() @ x2).mul_(scale)
        grad_b = (g2.t() @ xa).mul_(scale)
        return grad_x, None, None, grad_a, grad_b, None


def merges(tokens: int, fan_in: int, fan_out: int) -> bool:
    """Whether a call of ``tokens`` computes less through the merged matrix (made twice) than through the
    adapter's two thin products: ``tokens (in + out) > 2 in out``."""
    return tokens * (fan_in + fan_out) > 2 * fan_in * fan_out


def _fused_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """The layer's forward: the fused function where it applies (see the module's doc), else peft's own."""
    if not args and not kwargs and not self.disable_adapters and not self.merged:
        active = self.active_adapters
        if len(active) == 1 and active[0] in self.lora_A and active[0] not in self.lora_variant:
            name = active[0]
            base, a, b = self.base_layer, self.lora_A[name].weight, self.lora_B[name].weight
            weight, bias = base.weight, base.bias
            dropout = self.lora_dropout[name]
            if (
                type(base) is torch.nn.Linear
                and isinstance(dropout, torch.nn.Identity)
                and not getattr(self, "fan_in_fan_out", False)
                and not weight.requires_grad
                and (bias is None or not bias.requires_grad)
            ):
                out = fused_call(x, weight, bias, a, b, float(self.scaling[name]))
                if out is not None:  # None: operands of mixed dtypes, which peft's layer casts its own way
                    return out
    return self.ladle_peft_forward(x, *args, **kwargs)


def fused_call(x, weight, bias, a, b, scale: float) -> torch.Tensor | None:
    """The fused function on one dtype (None where the operands' dtypes differ outside autocast). Under autocast (mixed precision on a GPU) every operand is cast to
    autocast's dtype, as autocast casts ``F.linear``'s, and the function runs with autocast off: an autograd
    function's own products are not cast by autocast, and without the cast its inputs (a bf16 activation, fp32
    weights) differ in dtype, so every call went to peft's path while the run reported the fused layers on."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        cast = [t if t is None else t.to(dtype) for t in (x, weight, bias, a, b)]
        with torch.autocast(device, enabled=False):
            return fused_call(*cast, scale)
    if not (x.dtype == weight.dtype == a.dtype == b.dtype and (bias is None or bias.dtype == x.dtype)):
        return None
    tokens = x.numel() // x.shape[-1]
    fn = Merged if merges(tokens, weight.shape[1], weight.shape[0]) else Factored
    return fn.apply(x, weight, bias, a, b, scale)


_classes: dict[type, type] = {}


def fused_class(cls: type) -> type:
    """A subclass of peft's LoRA ``Linear`` whose forward takes the fused path (one per class, made once)."""
    if cls not in _classes:
        body = {"forward": _fused_forward, "ladle_peft_forward": cls.forward, "ladle_fused": True}
        _classes[cls] = type(f"Fused{cls.__name__}", (cls,), body)
    return _classes[cls]


def install(model) -> int:
    """Give every plain LoRA linear layer of ``model`` the fused forward (its class swapped for a subclass, so
    nothing else about the module changes); how many layers."""
    from peft.tuners.lora import Linear as LoraLinear

    count = 0
    for module in model.modules():
        if type(module) is LoraLinear:
            module.__class__ = fused_class(LoraLinear)
            count += 1
        elif getattr(type(module), "ladle_fused", False):
            count += 1
    return count


def plain_lora(module) -> bool:
    """Whether ``module`` is peft's plain LoRA linear layer, fused or not (not a quantized or other subclass)."""
    from peft.tuners.lora import Linear as LoraLinear

    return type(module) is LoraLinear or type(module) is _classes.get(LoraLinear)
