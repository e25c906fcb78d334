"""Writing a full model a part at a time (``ladle.train.saving``): names, parts and the folder Hugging Face loads."""

from __future__ import annotations

import json

import pytest
import torch

from ladle.train import saving


def small_llama(tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    return LlamaForCausalLM(config)


def test_parts_keep_order_and_stay_under_the_limit():
    sizes = [("a", 3), ("b", 4), ("c", 10), ("d", 1), ("e", 2), ("f", 5)]
    assert saving.group(sizes, 8) == [["a", "b"], ["c"], ["d", "e", "f"]]  # "c" is larger than a part: alone
    assert saving.group(sizes, 100) == [["a", "b", "c", "d", "e", "f"]]
    assert saving.group([], 8) == []


@pytest.mark.parametrize("tied", [True, False])
def test_model_tensors_name_each_weight_once_as_save_pretrained_does(tied, tmp_path):
    from safetensors.torch import load_file

    model = small_llama(tied)
    model.model.layers[0] = torch.compile(model.model.layers[0])  # an `_orig_mod.` wrapper part in the names
    names = list(saving.model_tensors(model))
    assert not any("_orig_mod" in n for n in names)
    model.model.layers[0] = model.model.layers[0]._orig_mod
    model.save_pretrained(tmp_path, safe_serialization=True)
    assert len(names) == len(set(names)) and set(names) == set(load_file(tmp_path / "model.safetensors"))
    assert ("lm_head.weight" in names) is not tied


def test_parts_written_as_an_indexed_folder_that_loads_back(tmp_path):
    from transformers import AutoModelForCausalLM

    model = small_llama(tied=True)
    tensors = saving.model_tensors(model)
    limit = 8 * 1024  # bytes: several files, the 8 KiB embedding alone in one
    sizes = [(n, t.numel() * t.element_size()) for n, t in tensors.items()]
    parts = ({n: tensors[n].detach().clone() for n in names} for names in saving.group(sizes, limit))
    saving.write_model_files(model, parts, tmp_path, limit, main=True)

    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(tmp_path.glob("model-*-of-*.safetensors"))
    assert len(files) == len(saving.group(sizes, limit)) > 3
    assert set(index["weight_map"]) == set(tensors) and set(index["weight_map"].values()) == {f.name for f in files}
    assert index["metadata"]["total_size"] == sum(size for _, size in sizes)
    assert not list(tmp_path.glob("part-*"))
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["dtype"] == "float32" and config["architectures"] == ["LlamaForCausalLM"]
    assert (tmp_path / "generation_config.json").exists()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    for name, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()  # tied again


def test_other_ranks_write_nothing(tmp_path):
    model = small_llama(tied=False)
    seen = []
    saving.write_model_files(model, (seen.append(i) for i in range(3)), tmp_path, 1024, main=False)
    assert len(seen) == 3 and not list(tmp_path.iterdir())  # every part iterated (the gathers), no file


def test_each_part_is_on_disk_before_the_next_is_gathered(tmp_path):
    """The writer consumes parts as they come: rank 0 holds one part, never the whole model."""
    model = small_llama(tied=False)
    tensors = saving.model_tensors(model)
    sizes = [(n, t.numel() * t.element_size()) for n, t in tensors.items()]
    groups = saving.group(sizes, 4096)
    written = []

    def parts():
        for i, names in enumerate(groups):
            written.append(len(list(tmp_path.glob("part-*.safetensors"))))
            assert written[-1] == i  # every earlier part already written
            yield {n: tensors[n].detach().clone() for n in names}

    saving.write_model_files(model, parts(), tmp_path, 4096, main=True)
    assert written == list(range(len(groups))) and len(groups) > 3
