"""N-D parallelism in the planner: degrees resolved and validated before any process starts, named strategies
as presets of degrees, and the planner's choice of degrees over (model x topology) with its reasons."""

from __future__ import annotations

import pytest

from ladle.config import build_config, load_config
from ladle.errors import ConfigError
from ladle.machine.topology import probe, probe_file
from ladle.plan.inputs import local_model_config
from ladle.plan.planner import Plan, make_plan
from ladle.sizing.params import read_config
from ladle.strategies.mesh import Dims, resolve
from tests.helpers import NVSWITCH_8, PCIE_8

CPU = probe(env={}, query_output="")
MINIMAL = {"base": "ladle://tiny-llama", "data": {"path": "ladle://demo-alpaca"}}
MODELS = {name: read_config(f"recipes/models/{name}") for name in ("llama-3.1-8b", "llama-3.1-70b")}


@pytest.fixture(autouse=True)
def tiny_config(tiny_model):
    """The tiny model's config.json exists, so CPU plans are checked against its shape."""


def cpu_plan(*overrides: str, processes: int = 4):
    cfg = build_config(MINIMAL, [f"parallelism.cpu_processes={processes}", *overrides])
    return make_plan(cfg, CPU, "my.yaml", model=local_model_config(cfg))  # the tiny model's config.json


def problems(*overrides: str, processes: int = 4) -> str:
    with pytest.raises(ConfigError) as info:
        cpu_plan(*overrides, processes=processes)
    return str(info.value)


@pytest.fixture(scope="module")
def machines(tmp_path_factory):
    root = tmp_path_factory.mktemp("topo")
    out = {}
    for name, text in (("nvswitch", NVSWITCH_8), ("pcie", PCIE_8)):
        (root / name).write_text(text)
        out[name] = probe_file(str(root / name), env={}, gpu_memory_gib=80)
    return out


def gpu_plan(machines, model: str, *overrides: str, nodes: int, machine: str = "nvswitch"):
    cfg = build_config(
        {
            "base": "b",
            "data": {"path": "d", "seq_len": 4096},
            "training": {"micro_batch_size": 1, "gradient_checkpointing": True, "dtype": "bfloat16"},
            "parallelism": {"nodes": nodes, "main_port": 29500, "main_address": "10.0.0.1"},
        },
        list(overrides),
    )
    return make_plan(cfg, machines[machine], "job.yaml", model=MODELS[model])


@pytest.mark.parametrize(
    ("overrides", "processes", "mesh"),
    [
        (["parallelism.strategy=ddp"], 4, "dp_replicate=4"),
        (["parallelism.strategy=fsdp2"], 4, "dp_shard=4"),
        (["parallelism.strategy=fsdp2", "parallelism.fsdp2.replicate=2"], 4, "dp_replicate=2 × dp_shard=2"),
        (["parallelism.strategy=zero3"], 4, "dp_shard=4"),
        (
            ["parallelism.strategy=pipeline", "parallelism.pipeline.allow_cpu=true", "parallelism.pipeline.stages=4"],
            4,
            "pp=4",
        ),
        (["parallelism.strategy=tp", "training.lora.enabled=false"], 2, "tp=2"),
        (["parallelism.strategy=ddp"], 1, "1 process"),
    ],
)
def test_named_strategies_are_presets_of_degrees(overrides, processes, mesh):
    made = cpu_plan(*overrides, processes=processes)
    assert Dims.of(made.mesh).describe() == mesh
    assert Dims.of(made.mesh).world == made.world_size
    assert f"| mesh | {mesh} |" in made.to_markdown()


@pytest.mark.parametrize(
    ("asked", "world", "resolved"),
    [
        ({"tp": 2}, 4, Dims(dp_shard=2, tp=2)),  # dp_shard takes the ranks left (torchtitan's -1)
        ({"pp": 2}, 4, Dims(pp=2, dp_shard=2)),
        ({"dp_shard": 2}, 4, Dims(dp_replicate=2, dp_shard=2)),  # then dp_replicate takes them
        ({"pp": 2, "dp_replicate": 2}, 4, Dims(pp=2, dp_replicate=2)),
        ({}, 8, Dims(dp_shard=8)),
    ],
)
def test_auto_degrees_take_the_ranks_left(asked, world, resolved):
    full = {name: asked.get(name, "auto") for name in ("pp", "dp_replicate", "dp_shard", "cp", "tp")}
    assert resolve(full, world) == (resolved, [])


def test_setting_a_degree_implies_nd_and_the_plan_shows_the_mesh():
    made = cpu_plan("parallelism.dims.tp=2", "training.lora.enabled=false")
    assert made.strategy == "nd" and made.mesh == Dims(dp_shard=2, tp=2).degrees()
    assert "parallelism.dims set: strategy nd runs what it asks for" in made.overrides
    text = made.to_markdown()
    assert "| mesh | dp_shard=2 × tp=2 |" in text
    assert "| batch | 8 rows/step = 4 micro x 2 replica(s) x 1 accumulation |" in text
    assert any(r.startswith("mesh dp_shard=2 × tp=2: 2 data-parallel replica(s)") for r in made.reasons)
    assert Plan.model_validate_json(made.model_dump_json()).mesh == made.mesh


def test_every_problem_with_the_degrees_is_reported_at_once():
    text = problems("parallelism.dims.tp=3", "parallelism.dims.pp=8", "parallelism.dims.cp=2", "data.seq_len=250")
    for expected in (
        "parallelism.dims: the set degrees multiply to 48, which does not divide the world size 4",
        "parallelism.dims.tp = 3: the model's num_attention_heads = 4 does not divide by it",
        "parallelism.dims.tp = 3: the model's num_key_value_heads = 2 does not divide by it",
        "parallelism.dims.pp = 8: the model has 4 decoder layers, fewer than the stages. Use pp <= 4.",
        "parallelism.dims.cp = 2: data.seq_len = 250 must divide by 2 × cp = 4",
        "parallelism.dims.cp = 2: context parallelism runs ring attention through torch's context_parallel, whose "
        "attention kernels are CUDA's only (flash, memory-efficient, cuDNN SDPA); this host has no GPU.",
        "parallelism.dims.tp = 3 with training.lora.enabled = true: peft's LoRA layer",
    ):
        assert expected in text, text


def test_a_product_that_is_not_the_world_names_each_degree():
    text = problems(
        *(f"parallelism.dims.{d}=1" for d in ("pp", "dp_replicate", "cp", "tp")), "parallelism.dims.dp_shard=2"
    )
    assert (
        "parallelism.dims = pp=1 × dp_replicate=1 × dp_shard=2 × cp=1 × sp=1 × tp=1: the product 2 must equal the world size 4"
        in text
    )


def test_one_process_is_no_mesh():
    text = problems("parallelism.dims.tp=1", processes=1)
    assert "parallelism.strategy = nd: a mesh of degrees needs at least 2 processes and this plan has 1" in text


def test_degrees_with_a_named_strategy_are_refused():
    text = problems("parallelism.strategy=fsdp2", "parallelism.dims.tp=2", "training.lora.enabled=false")
    assert "parallelism.dims (tp=2) with parallelism.strategy = fsdp2: a named strategy runs its own preset" in text
    assert "Set parallelism.strategy=nd (or auto)" in text


def test_1f1b_needs_a_microbatch_per_stage():
    text = problems(
        "parallelism.dims.pp=2",
        "parallelism.dims.dp_shard=2",
        "training.global_batch_size=2",
        "training.micro_batch_size=1",
    )
    assert "training.global_batch_size = 2: 1f1b needs at least one microbatch per stage (1 < pp = 2)" in text


def test_recipe_70b_full_fine_tune_gets_tp_inside_nodes_and_fsdp_across(machines):
    cfg = load_config("recipes/llama3-70b-nd.yaml")
    made = make_plan(cfg, machines["nvswitch"], model=local_model_config(cfg))
    assert (made.strategy, made.world_size, made.mesh) == ("nd", 32, Dims(dp_shard=4, tp=8).degrees())
    reason = next(r for r in made.reasons if r.startswith("strategy nd(dp_shard=4 × tp=8):"))
    assert "tp=8 inside each machine's nvswitch" in reason
    assert "0.375 of the weights cross machines per step (ZeRO-3: 3, ZeRO++: ~0.75 quantized)" in reason
    by_name = {c["strategy"]: c for c in made.candidates}
    # ranked by cross-machine traffic: tp=8 (0.375) before ZeRO++ (~0.75) before tp=4 (0.75 plus tp's all-reduces)
    order = list(by_name)
    assert order.index("nd(dp_shard=4 × tp=8)") < order.index("zero++") < order.index("nd(dp_shard=8 × tp=4)")
    assert by_name["nd(dp_shard=4 × tp=8)"]["fits"] and by_name["nd(pp=4 × tp=8)"]["fits"]
    assert made.launcher_config["mesh"]["tp"] == 8 and made.launcher_config["fsdp_mesh"] == [1, 4]


def test_70b_full_fine_tune_on_2x8_does_not_fit_without_offload(machines):
    made = gpu_plan(machines, "llama-3.1-70b", "training.lora.enabled=false", nodes=2)
    by_name = {c["strategy"]: c for c in made.candidates}
    assert not by_name["nd(dp_shard=2 × tp=8)"]["fits"]  # 18 bytes x 70.6B / 16 GPUs: 79 GB of states alone
    assert made.strategy == "zero3" and made.strategy_options["offload_optimizer"] == "cpu"


def test_small_models_get_no_tp_that_would_starve_the_gemms(machines):
    """Llama-3.1-8B (hidden 4096): tp=8 would leave 512 columns per rank, so it is not offered; tp=4 is, and
    ZeRO++ (same cross-machine traffic, no tp all-reduces) stays ahead of it."""
    made = gpu_plan(machines, "llama-3.1-8b", "training.lora.enabled=false", nodes=2)
    names = [c["strategy"] for c in made.candidates]
    assert "nd(dp_shard=4 × tp=4)" in names and not [n for n in names if "tp=8" in n]
    assert names.index("zero++") < names.index("nd(dp_shard=4 × tp=4)")
    assert made.strategy != "nd"


@pytest.mark.parametrize(
    ("overrides", "machine"),
    [(["training.lora.enabled=true"], "nvswitch"), (["training.lora.enabled=false"], "pcie")],
)
def test_no_tp_candidates_for_lora_or_slow_links(machines, overrides, machine):
    made = gpu_plan(machines, "llama-3.1-70b", *overrides, nodes=2, machine=machine)
    nd = [c["strategy"] for c in made.candidates if c["strategy"].startswith("nd")]
    assert nd and all("sp=" in name and "tp=" not in name for name in nd)  # only sequence parallelism, last


def test_no_tp_candidates_on_cpu_and_sequence_parallelism_only_last():
    made = cpu_plan("training.lora.enabled=false")
    names = [c["strategy"] for c in made.candidates]
    nd = [name for name in names if name.startswith("nd")]
    assert made.strategy != "nd" and nd == ["nd(dp_shard=2 × sp=2)", "nd(sp=4)"]  # the tiny model's 4 heads
    assert names[-2:] == nd


def test_one_machine_prefers_fsdp2_and_offers_tp_after_it(machines):
    made = gpu_plan(machines, "llama-3.1-70b", "training.lora.enabled=false", "parallelism.gpus=8", nodes=1)
    names = [c["strategy"] for c in made.candidates]
    assert names.index("fsdp2") < names.index("nd(tp=8)")
    nd = next(c for c in made.candidates if c["strategy"] == "nd(tp=8)")
    assert "one machine: tp divides activations at the cost of per-block all-reduces" in nd["why"]


def test_context_parallel_on_gpus_is_refused_with_the_reason(machines):
    with pytest.raises(ConfigError) as info:
        gpu_plan(machines, "llama-3.1-8b", "training.lora.enabled=false", "parallelism.dims.cp=2", nodes=1)
    assert "parallelism.dims.cp = 2: context parallelism is not wired in this version" in str(info.value)
