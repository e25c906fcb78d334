import torch

from ladle.lifecycle.merge import merge_adapter


def test_merged_logits_equal_base_plus_adapter(tiny_model, tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    peft_model = get_peft_model(
        base, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", modules_to_save=["lm_head"])
    )
    torch.manual_seed(0)
    with torch.no_grad():  # B starts at zero; give the adapter a real effect
        for name, param in peft_model.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                param.add_(torch.randn_like(param) * 0.05)
    peft_model.save_pretrained(tmp_path / "adapter")
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(tmp_path / "adapter")

    merge_adapter(tiny_model, tmp_path / "adapter", tmp_path / "merged")

    ids = torch.tensor([[1, 4, 30, 31, 32, 2, 5, 40, 41]])
    reference = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32), tmp_path / "adapter"
    ).eval()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
        got = merged(input_ids=ids).logits
        plain = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()(input_ids=ids).logits
    assert not torch.allclose(plain, expected, atol=1e-3)  # the adapter changes the output
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
    assert not any(k.startswith("base_model") for k in merged.state_dict())
    assert list((tmp_path / "merged").glob("*.safetensors"))


MERGE_PEAK = """
import json, resource, sys
from pathlib import Path
from ladle.lifecycle.merge import merge_adapter
import torch, transformers, peft, safetensors  # the baseline includes the libraries the merge uses
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
merge_adapter(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4])
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"growth_mib": (after - before) / 1024}))
"""


def test_streaming_merge_of_a_sharded_base(tiny_model, tmp_path):
    """A 123 MB base in 7 safetensors shards: the merge reads and writes shard by shard (its peak grows by far
    less than one copy of the weights), keeps the base's index, and equals peft's whole-model merge; the bf16
    output is the float32 merge rounded once."""
    import json
    import subprocess
    import sys

    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ladle.assets.demo import write_random_llama

    base = write_random_llama(
        tmp_path / "base",
        tiny_model,
        shard_mb=20,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=8000,
    )
    shards = sorted(base.glob("*.safetensors"))
    weights_mib = sum(f.stat().st_size for f in shards) / 2**20
    assert len(shards) >= 3 and (base / "model.safetensors.index.json").exists()
    peft_model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
        LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", modules_to_save=["lm_head"]),
    )
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                param.add_(torch.randn_like(param) * 0.05)
    peft_model.save_pretrained(tmp_path / "adapter")
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(tmp_path / "adapter")

    growth = {}
    for dtype in ("float32", "bfloat16"):
        done = subprocess.run(
            [sys.executable, "-c", MERGE_PEAK, str(base), str(tmp_path / "adapter"), str(tmp_path / dtype), dtype],
            capture_output=True,
            text=True,
            check=True,
        )
        growth[dtype] = json.loads(done.stdout.strip().splitlines()[-1])["growth_mib"]
    assert growth["float32"] < 0.5 * weights_mib, (growth, weights_mib)
    out = tmp_path / "float32"
    assert sorted(f.name for f in out.glob("*.safetensors")) == [f.name for f in shards]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == json.loads((base / "model.safetensors.index.json").read_text())["weight_map"]
    assert (out / "generation_config.json").exists() and (out / "tokenizer.json").exists()

    ids = torch.tensor([[1, 4, 30, 31, 32, 2, 5, 40, 41]])
    with torch.no_grad():
        expected = (
            PeftModel.from_pretrained(
                AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), tmp_path / "adapter"
            )
            .merge_and_unload()(input_ids=ids)
            .logits
        )
        got = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()(input_ids=ids).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
    # bf16: folded in float32, then rounded once: exactly the float32 merge's tensors in bf16.
    halved = AutoModelForCausalLM.from_pretrained(tmp_path / "bfloat16")
    assert next(halved.parameters()).dtype == torch.bfloat16
    full = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    for name, tensor in halved.state_dict().items():
        assert torch.equal(tensor, full[name].to(torch.bfloat16)), name
