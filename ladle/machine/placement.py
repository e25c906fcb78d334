"""Where a whole model is loaded for evaluation and the transformers backend: one device, or its layers spread
over every visible GPU when one cannot hold it (``sizing.spread_over``, the rule the planner sizes with)."""

from __future__ import annotations

from pathlib import Path

from ladle.sizing import EVAL_LOGITS_BYTES


def load_placed(model_dir: Path, transient_bytes: int = EVAL_LOGITS_BYTES):
    """Load ``model_dir`` where it fits with ``transient_bytes`` beside it (default: the eval loss's logits):
    one device, or (CUDA, more than one GPU's headroom) its layers spread over every visible GPU by
    accelerate's ``device_map="auto"``, by the rule the planner sized it with (``sizing.spread_over``)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ladle.sizing import spread_over

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gpus = torch.cuda.device_count() if device == "cuda" else 0
    memory = torch.cuda.get_device_properties(0).total_memory if gpus else None
    weights = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))
    if spread_over(weights, transient_bytes, gpus, memory) > 1:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, device_map="auto").eval()
        device = str(model.get_input_embeddings().weight.device)  # inputs enter where the embedding is
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    return model, AutoTokenizer.from_pretrained(model_dir), device
