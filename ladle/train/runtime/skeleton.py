"""A whole model on the meta device, for saving what no single rank holds as plain tensors."""

from __future__ import annotations


def meta_skeleton(hf_config, peft_config=None):
    """The architecture of ``hf_config`` (with the adapter of ``peft_config``) on the meta device.

    ``save_pretrained(state_dict=...)`` maps the gathered state dict onto this module tree without
    reading the model's own parameters, which may be stage slices (pipeline) or DTensors whose
    gathering is a collective that rank 0 alone must not start (tensor parallel).
    """
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    if getattr(hf_config, "distributed_config", None) is not None:
        # A tensor-parallel load records its mesh here; saving from a config that carries it would
        # start rank-0-only collectives and write the run's layout into the output's config.json.
        hf_config = copy.deepcopy(hf_config)
        hf_config.distributed_config = None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    if peft_config is None:
        return model
    from peft import get_peft_model

    return get_peft_model(model, peft_config)
