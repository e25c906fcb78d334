"""Sharded loading's arithmetic on a 70B meta model, the planner's load/merge/serve figures, and the refusals
that come before any process starts (QLoRA without bitsandbytes, a merge the host cannot hold)."""

from __future__ import annotations

import pytest
import torch

from ladle.config import build_config, load_config
from ladle.errors import ConfigError
from ladle.machine.topology import probe, probe_file
from ladle.plan.inputs import local_model_config
from ladle.plan.planner import make_plan
from ladle.strategies.deepspeed import ENGINE_HOST_BYTES
from ladle.train.loading import checkpoint_name, shard_range
from tests.helpers import NVSWITCH_8

CPU = probe(env={}, query_output="")
MINIMAL = {"base": "ladle://tiny-llama", "data": {"path": "ladle://demo-alpaca"}}


def tiny_config() -> dict:
    import json

    from ladle.assets import resolve_base

    return json.loads((resolve_base("ladle://tiny-llama") / "config.json").read_text())


@pytest.mark.parametrize("rows", [1, 7, 8, 9, 128, 1000])
@pytest.mark.parametrize("shards", [1, 2, 3, 8])
def test_shard_rows_are_torch_chunk_rows(rows, shards):
    chunks = torch.arange(rows).chunk(shards)
    for coordinate in range(shards):
        start, length = shard_range(rows, shards, coordinate)
        expected = chunks[coordinate].tolist() if coordinate < len(chunks) else []
        assert list(range(start, start + length)) == expected


def test_peft_names_map_to_checkpoint_tensors():
    assert checkpoint_name("base_model.model.model.layers.3.self_attn.q_proj.base_layer.weight") == (
        "model.layers.3.self_attn.q_proj.weight"
    )
    assert checkpoint_name("base_model.model.lm_head.modules_to_save.default.weight") == "lm_head.weight"
    assert checkpoint_name("base_model.model.lm_head.original_module.weight") == "lm_head.weight"
    assert checkpoint_name("model.norm.weight") == "model.norm.weight"


def recorded(tmp_path, gib=80):
    (tmp_path / "topo.txt").write_text(NVSWITCH_8)
    return probe_file(str(tmp_path / "topo.txt"), env={}, gpu_memory_gib=gib)


def test_70b_meta_model_each_rank_materialises_an_eighth(tmp_path):
    """The 70B recipe's FSDP2 plan: built on the meta device (nothing allocated), every rank's dim-0 rows of
    every tensor, as the loader reads them, add up to 1/8 of the weights; the plan's load figure agrees."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = load_config("recipes/llama3-70b-fsdp2.yaml")
    model = local_model_config(cfg)
    plan = make_plan(cfg, recorded(tmp_path), model=model)
    assert plan.strategy == "fsdp2" and plan.world_size == 8
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.for_model(**model))
    total = sum(p.numel() for p in skeleton.parameters())
    assert total == 70_553_706_496
    held = [0] * plan.world_size
    for p in skeleton.parameters():
        per_row = p.numel() // p.shape[0]
        for rank in range(plan.world_size):
            held[rank] += shard_range(p.shape[0], plan.world_size, rank)[1] * per_row
    assert sum(held) == total
    for share in held:
        assert share == pytest.approx(total / 8, rel=0.001)
    weights_per_rank = 2 * total / 8  # bf16
    largest = 128_256 * 8192 * 2  # the embedding, read whole by no rank: its rows are
    adapters_and_context = 2 * 2**30
    assert weights_per_rank <= plan.memory["load"] <= weights_per_rank + largest + adapters_and_context
    assert plan.memory["train"] > plan.memory["load"]


@pytest.mark.parametrize("recipe", ["llama3-70b-fsdp2", "qwen3-32b-zeropp"])
def test_plan_reports_load_train_merge_and_serve_memory(recipe, tmp_path):
    from ladle.plan.planner import Plan

    cfg = load_config(f"recipes/{recipe}.yaml")
    plan = make_plan(cfg, recorded(tmp_path), model=local_model_config(cfg))
    assert set(plan.memory) == {"load", "train", "merge", "evaluate", "serve"}
    assert all(v > 0 for k, v in plan.memory.items() if k != "merge")
    assert any(r.startswith("memory per rank: loading") for r in plan.reasons)
    backend = cfg.serve.backend  # mii shards the 70B; transformers spreads the 32B and its KV cache over the GPUs
    assert any(r.startswith(f"serve ({backend}): ") and "over 8 device(s)" in r for r in plan.reasons)
    assert Plan.model_validate_json(plan.model_dump_json()).memory == plan.memory


def test_serving_that_cannot_fit_is_said_before_training(tmp_path):
    cfg = load_config("recipes/llama3-70b-fsdp2.yaml")
    spread = build_config(cfg.model_dump(exclude_unset=True), ["serve.backend=transformers"])
    plan = make_plan(spread, recorded(tmp_path), model=local_model_config(spread))
    assert not [w for w in plan.warnings if w.startswith("serve.backend")]  # 141 GB spread over 8 GPUs fits
    huge = build_config(
        cfg.model_dump(exclude_unset=True), ["serve.backend=transformers", "serve.kv_cache_tokens=9000000"]
    )
    plan = make_plan(huge, recorded(tmp_path), model=local_model_config(huge))
    warning = next(w for w in plan.warnings if w.startswith("serve.backend = transformers: serving the merged"))
    assert "over 8 device(s) and each has 80.0 GiB" in warning and "lower serve.kv_cache_tokens" in warning


def test_merge_that_cannot_fit_this_host_is_refused(monkeypatch):
    monkeypatch.setattr("ladle.plan.memory.host_bytes", lambda: 2**20)
    with pytest.raises(ConfigError) as err:
        make_plan(build_config(MINIMAL, []), CPU, model=tiny_config())
    assert "training.lora.enabled = true: merging the adapter needs" in str(err.value)
    assert "this host has 1.0 MiB" in str(err.value)


def test_qlora_without_bitsandbytes_names_the_extra(monkeypatch):
    monkeypatch.setattr("ladle.plan.planner.bitsandbytes_installed", lambda: False)
    with pytest.raises(ConfigError) as err:
        make_plan(build_config(MINIMAL, ["training.quantization.mode=nf4"]), CPU)
    assert "training.quantization.mode = nf4: 4-bit QLoRA quantizes the base with bitsandbytes, which is not " in str(
        err.value
    )
    assert "pip install 'ladle[qlora]'" in str(err.value)


def test_deepspeed_buckets_are_sized_from_the_model():
    model = tiny_config()
    plan = make_plan(build_config(MINIMAL, ["parallelism.strategy=zero3"]), CPU, model=model)
    zero = plan.launcher_config["zero_optimization"]
    hidden = model["hidden_size"]
    assert zero["reduce_bucket_size"] == hidden * hidden
    assert zero["stage3_max_reuse_distance"] == plan.model_shape["layer_params"]
    assert any("stage3_max_live_parameters" in r and "(auto)" in r for r in plan.reasons)
    largest = max(plan.model_shape["layer_params"], plan.model_shape["largest_tensor"])
    assert zero["sub_group_size"] == largest
    assert any(r.startswith(f"deepspeed sub_group_size {largest:,} (auto): one decoder layer") for r in plan.reasons)
    unknown = make_plan(build_config(MINIMAL, ["parallelism.strategy=zero3"]), CPU)
    assert unknown.launcher_config["zero_optimization"]["reduce_bucket_size"] == 500_000_000
    assert any("model size is unknown (DeepSpeed's default)" in r for r in unknown.reasons)


def test_optimizer_offload_renders_deepspeeds_own_optimizer(tmp_path):
    cfg = build_config(MINIMAL, ["parallelism.strategy=zero2", "parallelism.deepspeed.offload_optimizer=cpu"])
    plan = make_plan(cfg, recorded(tmp_path))
    optimizer = plan.launcher_config["optimizer"]
    assert optimizer["type"] == "AdamW" and optimizer["params"]["lr"] == cfg.training.lr
    assert any("DeepSpeedCPUAdam" in r for r in plan.reasons)
    from ladle.strategies.deepspeed_json import validate_with_deepspeed

    validate_with_deepspeed(plan.launcher_config, plan.world_size)


def test_step_and_save_transients_are_sized():
    """The optimizer step's temporaries and the save's gathered outputs: ZeRO-3 steps one sub-group at a time
    (a float32 gradient copy and AdamW's temporary per element), so DeepSpeed's 1e9 default costs its whole
    partition; torch AdamW on CPU goes tensor by tensor; on CPU the save's gathered part sits on rank 0."""
    from ladle.plan.planner import plan_estimate

    model = tiny_config()
    full = ["training.lora.enabled=false"]

    def estimate(*overrides):
        cfg = build_config(MINIMAL, [*full, *overrides])
        return plan_estimate(cfg, make_plan(cfg, CPU, model=model), model)

    auto = estimate("parallelism.strategy=zero3")
    whole = estimate("parallelism.strategy=zero3", "parallelism.deepspeed.sub_group_size=1000000000")
    plan = make_plan(build_config(MINIMAL, [*full, "parallelism.strategy=zero3"]), CPU, model=model)
    shape, world = plan.model_shape, plan.world_size
    assert auto.step == 8 * max(shape["layer_params"], shape["largest_tensor"])
    assert whole.step == 8 * (shape["params"] // world) > auto.step
    ddp = estimate("parallelism.strategy=ddp")
    assert ddp.step == 8 * shape["largest_tensor"]  # sqrt(v) and its quotient, one tensor at a time
    # Rank 0 gathers a part of the weights at a time (512 MiB: the tiny model is one part) plus the tensor being
    # gathered. DDP's gradients live in its reducer's buckets, which zero_grad does not free (nor does DeepSpeed
    # free its gradient partitions); with gradient_as_bucket_view off, zero_grad frees the gradients beside the
    # buckets, and the reducer holds a second copy of them throughout.
    largest = 4 * shape["largest_tensor"]
    assert world == 2 and ddp.save == 4 * shape["params"] + largest and ddp.gradients == 4 * shape["params"]
    copied = estimate("parallelism.strategy=ddp", "parallelism.ddp.gradient_as_bucket_view=false")
    assert copied.save == 4 * shape["params"] + largest - 4 * shape["params"]
    assert copied.gradients == 2 * ddp.gradients and copied.peak > ddp.peak == max(ddp.total, ddp.load)
    # Accumulating, the no_sync micro-batches' gradients sit beside the buckets until the synchronising backward.
    micro = plan.micro_batch_size
    accumulating = estimate("parallelism.strategy=ddp", f"training.global_batch_size={4 * micro * world}")
    assert accumulating.gradients == copied.gradients and accumulating.save == ddp.save
    assert auto.save == 4 * shape["params"] + largest
    assert auto.context == ENGINE_HOST_BYTES  # DeepSpeed's engine on a CPU host
    assert auto.peak == max(auto.total, auto.load + auto.context, auto.states + auto.save + auto.context)
    # deepspeed.initialize's buffers beside the loaded weights: ZeRO-3's gradient partitions and its float32
    # master (a clone in float32 until share_master drops it); ZeRO-1/2 flatten the float32 replica (two copies).
    assert auto.load == max(4 * shape["params"] // world + 2 * largest, 12 * shape["params"] // world)
    zero1 = estimate("parallelism.strategy=zero1")
    assert zero1.load == 8 * shape["params"] + largest
    # float32 ZeRO-1/2 at their step: a 4-byte replica, the float32 gradient partition and its moments, no master
    for stage in (zero1, estimate("parallelism.strategy=zero2")):
        assert (stage.weights, stage.gradients, stage.optimizer) == (
            4 * shape["params"],
            4 * shape["params"] // world,
            8 * shape["params"] // world,
        )
    parted = estimate("parallelism.strategy=zero3", "training.save_shard_mib=1")  # 1 MiB parts
    assert 4 * shape["params"] > 2**20 and parted.save == max(2**20, largest) + largest < auto.save


def test_on_gpus_the_step_is_foreachs_and_the_save_goes_to_the_host(tmp_path):
    from ladle.plan.planner import plan_estimate

    model = tiny_config()
    cfg = build_config(MINIMAL, ["training.lora.enabled=false", "parallelism.strategy=fsdp2"])
    plan = make_plan(cfg, recorded(tmp_path), model=model)
    est = plan_estimate(cfg, plan, model)
    assert est.save == 0 and "save" not in plan.memory  # gathered to host memory, not the device
    assert est.step == 4 * (est.optimizer // 16)  # foreach AdamW: sqrt(v) of every local element at once


@pytest.mark.parametrize(("model_name", "stages"), [("llama-3.1-8b", 3), ("llama-3.2-1b", 3)])
def test_pipeline_states_are_the_fullest_stages(model_name, stages):
    """A float32 pipeline's per-rank states are 16 bytes (weights, gradients, AdamW's two moments) per parameter
    of the fullest stage, as ``StageModule`` splits a meta model: the first stage takes the remainder of the
    layers and the embedding, the last the head (a tied head is a second copy there)."""
    import json

    from transformers import AutoConfig, AutoModelForCausalLM

    from ladle.assets import recipes_dir
    from ladle.plan.planner import plan_estimate
    from ladle.train.runtime.pipeline_stage import StageModule

    model = json.loads((recipes_dir() / "models" / model_name / "config.json").read_text())
    held = []
    for stage in range(stages):
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(AutoConfig.for_model(**model))
        held.append(sum(p.numel() for p in StageModule(skeleton, stage, stages).parameters()))
    base = f"ladle://models/{model_name}"
    overrides = ["training.lora.enabled=false", "parallelism.strategy=pipeline", "parallelism.pipeline.allow_cpu=true"]
    cfg = build_config(
        {**MINIMAL, "base": base},
        [*overrides, f"parallelism.cpu_processes={stages}", f"parallelism.pipeline.stages={stages}"],
    )
    plan = make_plan(cfg, CPU, model=model)
    assert (plan.strategy, plan.world_size, plan.dtype) == ("pipeline", stages, "float32")
    est = plan_estimate(cfg, plan, model)
    # The norms (a few thousand parameters per layer) are the only weights the shape's formula leaves out.
    assert est.states == pytest.approx(16 * max(held), rel=0.001)
    assert max(held) > 1.05 * sum(held) / stages  # the even split the model used to assume is off by > 5 %
