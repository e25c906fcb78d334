"""Ulysses sequence parallelism in the planner: sp's bad input refused in one go with each value and its fix,
activations counted per rank as seq_len / sp, and sp chosen only when no layout that keeps whole rows on a rank
fits even with recomputation (the long-context recipe, planned on a recorded 8x H100 node)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ladle.config import build_config, load_config
from ladle.errors import ConfigError
from ladle.machine.topology import probe, probe_file
from ladle.plan.inputs import local_model_config
from ladle.plan.planner import make_plan
from ladle.sizing.params import read_config
from ladle.strategies.mesh import Dims
from tests.helpers import NVSWITCH_8

CPU = probe(env={}, query_output="")
MINIMAL = {"base": "ladle://tiny-llama", "data": {"path": "ladle://demo-alpaca", "seq_len": 128}}


@pytest.fixture(scope="module")
def h100x8(tmp_path_factory):
    path = tmp_path_factory.mktemp("topo") / "nvswitch"
    path.write_text(NVSWITCH_8)
    return probe_file(str(path), env={}, gpu_memory_gib=80)


def cpu_plan(*overrides: str, processes: int = 4, model: dict | None = None):
    cfg = build_config(MINIMAL, [f"parallelism.cpu_processes={processes}", *overrides])
    return make_plan(cfg, CPU, "my.yaml", model=model or local_model_config(cfg))


def problems(*overrides: str, processes: int = 4, model: dict | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        cpu_plan(*overrides, processes=processes, model=model)
    return str(info.value)


def test_sp_plans_as_a_mesh_degree_with_fsdp_over_dp_shard_and_sp(tiny_model):
    made = cpu_plan("parallelism.dims.sp=2")
    assert made.strategy == "nd" and made.mesh == Dims(dp_shard=2, sp=2).degrees()
    assert made.launcher_config["fsdp_mesh"] == [1, 4]
    assert any(r.startswith("sp=2: every row split into 2 slices of 64 tokens") for r in made.reasons)
    assert made.kernels["fused_loss"] == "chunked" and made.kernels["padding_free"] is True  # whole forward per rank


def test_activations_per_rank_divide_by_sp(tiny_model):
    from ladle import strategies
    from ladle.plan.memory import sizing_job
    from ladle.sizing import all_to_all_bytes
    from ladle.strategies import Target

    nd = strategies.get("nd")
    sizes = []
    for dims in ("parallelism.dims.dp_shard=4", "parallelism.dims.sp=2", "parallelism.dims.sp=4"):
        cfg = build_config(MINIMAL, ["parallelism.cpu_processes=4", "data.seq_len=1024", dims])
        job = sizing_job(cfg, local_model_config(cfg), Target("cpu", 4, 1, "float32"), 4)
        sizes.append(nd.activations(job, nd.options(cfg))[0])
    # seq_len / sp tokens per rank (4 rows x 1024 tokens: 2048, then 1024), plus one layer's all-to-all buffers
    assert sizes[1] == sizes[0] // 2 + all_to_all_bytes(job.shape, 2048, 4, sp=2)
    assert sizes[2] == sizes[0] // 4 + all_to_all_bytes(job.shape, 1024, 4, sp=4)  # 2 KV heads: repeated


@pytest.mark.parametrize(
    ("overrides", "processes", "expected"),
    [
        (["parallelism.dims.sp=3"], 3, "the model's num_attention_heads = 4 does not divide by it"),
        (["parallelism.dims.sp=8"], 8, "num_attention_heads = 4 does not divide by it"),  # sp above the heads
        (["parallelism.dims.sp=2", "data.seq_len=129"], 2, "data.seq_len = 129 does not divide by it"),
        (["parallelism.dims.sp=2", "parallelism.dims.tp=2"], 4, "sp = 2 with tp = 2: not composed in this version"),
        (["parallelism.dims.sp=2", "parallelism.dims.pp=2"], 4, "sp = 2 with pp = 2: not composed in this version"),
    ],
)
def test_bad_sp_is_refused_naming_the_values(tiny_model, overrides, processes, expected):
    text = problems(*overrides, processes=processes)
    assert expected in text and "parallelism.dims.sp" in text


def test_sp_on_a_model_whose_attention_it_cannot_take_over(tiny_model):
    windowed = {**read_config(str(tiny_model)), "model_type": "mistral", "sliding_window": 64}
    text = problems("parallelism.dims.sp=2", processes=2, model=windowed)
    assert "parallelism.dims.sp = 2: mistral uses sliding-window attention" in text
    assert "Set parallelism.dims.sp=1" in text


def test_ring_context_parallelism_stays_refused_and_points_at_sp(tiny_model):
    text = problems("parallelism.dims.cp=2", processes=2)
    assert "ring attention" in text and "parallelism.dims.sp" in text


def test_long_context_recipe_splits_sequences_only_because_nothing_else_fits(h100x8):
    cfg = load_config("recipes/llama3-70b-64k-sp.yaml")
    made = make_plan(cfg, h100x8, "recipe.yaml", model=local_model_config(cfg))
    assert (made.strategy, made.world_size, made.mesh) == ("nd", 8, Dims(dp_shard=2, sp=4).degrees())
    assert made.gradient_checkpointing
    assert any(r.startswith("activation checkpointing on (auto): no layout that keeps whole") for r in made.reasons)
    why = next(r for r in made.reasons if r.startswith("sequence parallelism: with whole sequences on each rank"))
    assert "fsdp2, needs" in why and "more than 72.0 GiB usable of 80.0 GiB per rank" in why
    by_name = {c["strategy"]: c for c in made.candidates}
    assert not by_name["fsdp2"]["fits"] and not by_name["nd(dp_shard=4 × sp=2)"]["fits"]
    assert by_name["nd(dp_shard=2 × sp=4)"]["fits"] and by_name["nd(sp=8)"]["fits"]
    # the smallest sp that fits, ranked after every layout that keeps whole rows
    names = list(by_name)
    assert names.index("nd(dp_shard=2 × sp=4)") > max(names.index(n) for n in ("ddp", "fsdp2", "zero3"))
    assert 40 < by_name["nd(dp_shard=2 × sp=4)"]["per_rank_gib"] < 72
    assert "not yet run on a GPU" in Path("recipes/llama3-70b-64k-sp.yaml").read_text()


def test_a_short_context_never_splits_sequences(h100x8):
    cfg = load_config("recipes/llama3-70b-64k-sp.yaml", ["data.seq_len=4096"])
    made = make_plan(cfg, h100x8, "recipe.yaml", model=local_model_config(cfg))
    assert made.strategy == "fsdp2" and made.mesh["sp"] == 1


def test_padding_free_and_packed_attention_may_be_asked_with_sp_but_not_with_pipeline_stages(tiny_model):
    made = cpu_plan(
        "parallelism.dims.sp=2", "training.kernels.padding_free=true", "training.kernels.packed_attention=true"
    )
    assert made.kernels["padding_free"] is True and made.kernels["packed_attention"] == "on"
    text = problems("parallelism.dims.pp=2", "training.kernels.padding_free=true")
    assert "training.kernels.padding_free = true with parallelism.strategy = nd" in text


def test_all_to_all_buffers_count_the_repeated_kv_heads():
    """8 query heads and 2 KV heads at sp=4: each KV head is exchanged twice (``kv_repeats``), so k and v are
    twice as wide in the all-to-all as in the model; at sp=2 they divide and go as they are."""
    import dataclasses

    from ladle.sizing import ModelShape, all_to_all_bytes, kv_repeats

    shape = ModelShape(0, 0, 2, 512, 1024, kv_dim=128, heads=8, vocab=100, embedding_params=0, layer_params=0)
    gqa = dataclasses.replace(shape, kv_heads=2)
    assert (kv_repeats(8, 2, 4), kv_repeats(8, 2, 2), kv_repeats(8, 1, 4)) == (2, 1, 4)
    assert all_to_all_bytes(gqa, 100, 2, sp=4) == (2 * 512 + 2 * 128 * 2) * 100 * 2
    assert all_to_all_bytes(gqa, 100, 2, sp=2) == (2 * 512 + 2 * 128) * 100 * 2
    assert all_to_all_bytes(shape, 100, 2, sp=4) == (2 * 512 + 2 * 128) * 100 * 2  # kv_heads 0: as many as heads
