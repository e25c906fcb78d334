"""A real pretrained model through ladle: SmolLM2-135M-Instruct from its shipped GGUF file, converted once
(shared by the tests here), fine-tuned for a few steps on 2 gloo processes, merged, and served.

What a random-init model cannot show: the tokenizer, chat template and tied embedding of a real checkpoint
survive conversion, training and merge; the merged model answers exactly as base + adapter does (greedy
answers equal, next-token distributions within a KL of 1e-3 per token in float32); the server streams the
answer offline ``generate`` gives.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import openai
import pytest
import torch

from tests.helpers import offline_greedy, train_spec

pytestmark = pytest.mark.pipeline
BASE = "ladle://smollm2-135m-instruct"


@pytest.fixture(scope="module")
def smollm2() -> Path:
    from ladle.assets import resolve_base

    return resolve_base(BASE, "float32")


def test_the_gguf_file_becomes_an_ordinary_folder_that_answers(smollm2):
    from transformers import AutoTokenizer

    config = json.loads((smollm2 / "config.json").read_text())
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is True
    assert "quantization_config" not in config
    assert json.loads((smollm2 / "generation_config.json").read_text())["eos_token_id"] == 2
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    assert "<|im_start|>" in tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"
    from safetensors import safe_open

    with safe_open(str(smollm2 / "model.safetensors"), "pt") as f:
        count = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118 - not a dict
    assert count == 134_515_008  # tied: the head is the embedding, stored once
    answer = offline_greedy(smollm2, [{"role": "user", "content": "What is the capital of France?"}], 12)
    assert "Paris" in answer, answer


@pytest.fixture(scope="module")
def fine_tuned(smollm2, tmp_path_factory):
    """A few LoRA steps on the demo tasks under FSDP2 on 2 gloo processes, and the merge of their adapter."""
    from ladle.config import build_config
    from ladle.lifecycle.merge import merge
    from ladle.train.run import launch

    root = tmp_path_factory.mktemp("smollm2")
    cfg = build_config(
        {
            "base": BASE,
            # 16 held-out examples: the prompts below read 4; the run's own eval loss (before and after, through
            # SmolLM2's 49k-token head) is not what this module proves, and 80 examples made it 2/3 of the run.
            "data": {"path": "ladle://demo-alpaca", "seq_len": 128, "eval_ratio": 0.01},
            "training": {
                "max_steps": 3,
                "lr": 2e-3,
                "warmup_steps": 0,
                "micro_batch_size": 2,
                "global_batch_size": 4,
                "checkpoint_every": 0,
                "lora": {"r": 8, "alpha": 16, "target_modules": "all-linear"},
            },
            # FSDP2: sharded loading of a tied embedding and head (a checkpoint without lm_head.weight)
            "parallelism": {"cpu_processes": 2, "strategy": "fsdp2"},
        },
        [],
    )
    spec = train_spec(cfg, root)
    result = launch(spec)
    merged = merge(smollm2, result, str(root / "run"))
    return spec, result, Path(merged.url)


def held_out(spec, limit: int) -> list[list[dict]]:
    from ladle.lifecycle.evaluate import load_samples, prompt_of

    return [prompt_of(m) for m in load_samples(spec.dataset, limit)]


# slow: a real model's conversion and answers are proven in make test (the test above); merged == base + adapter
# by tests/train/test_merge.py on the tiny model. This adds a real model's fine-tune.
@pytest.mark.slow
def test_a_real_fine_tune_merges_to_what_base_plus_adapter_answers(smollm2, fine_tuned):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec, result, merged_dir = fine_tuned
    assert result.world_size == 2 and result.strategy == "fsdp2" and len(result.train_losses) == 3
    # The merged folder is a complete chat model: tokenizer, template, special tokens, generation config.
    base_tok, merged_tok = AutoTokenizer.from_pretrained(smollm2), AutoTokenizer.from_pretrained(merged_dir)
    assert merged_tok.chat_template == base_tok.chat_template
    assert (merged_tok.bos_token, merged_tok.eos_token, merged_tok.pad_token) == (
        base_tok.bos_token,
        base_tok.eos_token,
        base_tok.pad_token,
    )
    generation = json.loads((merged_dir / "generation_config.json").read_text())
    assert (generation["eos_token_id"], generation["pad_token_id"]) == (2, 2)

    reference = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32), result.adapter_url
    ).eval()
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    kl_merge, kl_adapter = [], []
    for prompt in held_out(spec, 4):
        text = base_tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        ids = base_tok(text, add_special_tokens=False, return_tensors="pt").input_ids
        with torch.no_grad():
            want = reference.generate(ids, do_sample=False, max_new_tokens=12, pad_token_id=2, eos_token_id=2)
            got = merged.generate(ids, do_sample=False, max_new_tokens=12, pad_token_id=2, eos_token_id=2)
            assert got.tolist() == want.tolist(), (prompt, base_tok.decode(want[0]), base_tok.decode(got[0]))
            p = torch.log_softmax(reference(input_ids=want).logits.float(), -1)
            q = torch.log_softmax(merged(input_ids=want).logits.float(), -1)
            with reference.disable_adapter():  # the base alone
                r = torch.log_softmax(reference(input_ids=want).logits.float(), -1)
        kl_merge.append(torch.sum(p.exp() * (p - q), -1).max().item())
        kl_adapter.append(torch.sum(p.exp() * (p - r), -1).max().item())
    print(f"KL(base+adapter || merged) per token: max {max(kl_merge):.2e}; adapter vs base: max {max(kl_adapter):.3f}")
    assert max(kl_merge) <= 1e-3, kl_merge
    assert max(kl_adapter) > 0.05, kl_adapter  # three steps moved the model: the comparison is not vacuous


# slow: streaming == offline generate is proven in make test by tests/serve on the tiny model.
@pytest.mark.slow
def test_the_merged_real_model_streams_what_offline_generate_answers(fine_tuned):
    from ladle.serve.backends import TransformersBackend
    from ladle.serve.server import Settings, create_app
    from tests.serve.running import Running

    spec, _, merged_dir = fine_tuned
    running = Running(create_app(TransformersBackend(str(merged_dir), max_batch=4), Settings("smollm2", 16)))
    try:
        client = openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0)
        for messages in [*held_out(spec, 2), [{"role": "user", "content": "What is the capital of France?"}]]:
            chunks = client.chat.completions.create(
                model="smollm2", messages=messages, max_tokens=16, temperature=0, stream=True
            )
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert text == offline_greedy(merged_dir, messages, 16), messages
            assert text.strip()
    finally:
        running.stop()
