import torch

from ladle.merge import merge_adapter


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
