"""ZeRO-3's engine set-up on a 16-bit run: one dtype for the trainable parameters it packs together."""

from __future__ import annotations

import torch


def test_zero3_gives_its_extra_trainables_the_run_dtype():
    """ZeRO-3 packs a group's partitions into one buffer of one dtype; peft's float32 adapters beside a bf16
    ``modules_to_save`` head broke that on a GPU. Only trainable parameters ZeRO-3 did not create change."""
    from ladle.train.runtime.zero import one_dtype

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    model[1].to(torch.bfloat16)
    model[2].weight.requires_grad_(False)
    model[0].bias.ds_id = 7  # a ZeRO-3 parameter: its dtype is the engine's business
    one_dtype(model, "bfloat16")
    assert (model[0].weight.dtype, model[1].weight.dtype, model[2].bias.dtype) == (torch.bfloat16,) * 3
    assert (model[0].bias.dtype, model[2].weight.dtype) == (torch.float32, torch.float32)
