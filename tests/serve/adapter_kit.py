"""LoRA adapters of the tiny model for the serving tests: random-initialized (their B matrices too, so each one
changes the answers), saved as training saves them (peft's folder and ladle's record of the base), and each one
merged into a full model by ladle's merge stage, the reference its unmerged answers are held to."""

from __future__ import annotations

from pathlib import Path

import torch

SHAPES = {  # name: (rank, target modules, seed)
    "red": (4, ["q_proj", "v_proj"], 1),
    "blue": (8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 2),
    "green": (2, ["up_proj", "down_proj"], 3),
}


def make_adapter(
    base: Path, out: Path, rank: int, targets: list[str], seed: int, record: bool = True, saved: tuple = ()
) -> Path:
    """``saved``: modules the adapter replaces whole (peft's ``modules_to_save``), each copy moved off the base's."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ladle.serve.adapters import write_record

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    settings = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, modules_to_save=list(saved) or None)
    peft = get_peft_model(model, settings)
    for name, tensor in peft.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(tensor, std=0.3)
        elif "modules_to_save" in name:
            with torch.no_grad():
                tensor.add_(torch.randn_like(tensor) * tensor.std())
    peft.save_pretrained(out)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)  # as training saves an adapter
    if record:
        write_record(out, base, str(base))
    return out


def make_set(base: Path, root: Path) -> dict[str, tuple[Path, Path]]:
    """Each adapter of ``SHAPES``: (its folder, its merged model's folder)."""
    from ladle.lifecycle.merge import merge_adapter

    made = {}
    for name, (rank, targets, seed) in SHAPES.items():
        adapter = make_adapter(base, root / name, rank, targets, seed)
        merged = root / f"{name}-merged"
        merge_adapter(base, adapter, merged)
        made[name] = (adapter, merged)
    return made
