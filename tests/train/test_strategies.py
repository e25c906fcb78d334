"""Real 2-process gloo runs of each strategy: same losses as DDP, real sharding, usable adapters, exact resume."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ladle.lifecycle.merge import merge_adapter
from ladle.platform import storage
from ladle.train.checkpoint import step_dir
from ladle.train.run import launch
from ladle.train.spec import TrainSpec
from tests.helpers import launch_all, strategy_spec

pytestmark = pytest.mark.pipeline
STEPS = 6


def saved_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a saved model, whatever its number of safetensors files."""
    return {k: v for file in sorted(folder.glob("*.safetensors")) for k, v in load_file(file).items()}


def spec_for(strategy: str, root, *overrides: str) -> TrainSpec:
    return strategy_spec(strategy, root, *overrides, steps=STEPS)


SHARDED = ("zero1", "zero2", "zero3", "zero++", "fsdp2", "pipeline")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model):
    root = tmp_path_factory.mktemp("strategies")
    specs = {name: spec_for(name, root) for name in ("ddp", *SHARDED)}
    # DDP the plain way: the head and loss as the model computes them (every run above uses the chunked fused loss
    # on CPU), padded rows with transformers' masked attention (the runs above join each micro-batch's rows and
    # run attention example by example), and every layer's activations recomputed in backward (auto leaves that
    # off for this tiny model). All are exact, so one run checks them all against "ddp" (one run fewer in this
    # module's setup).
    specs["ddp plain"] = spec_for(
        "ddp",
        root / "plain",
        "training.kernels.fused_loss=off",
        "training.kernels.padding_free=false",
        "training.kernels.packed_attention=false",
        "training.kernels.lora_fused=false",
        "training.gradient_checkpointing=true",
    )
    results = launch_all(specs)
    return {name: (results[name], specs[name]) for name in specs}


@pytest.mark.parametrize("name", SHARDED)
def test_losses_match_ddp(runs, name):
    ddp, other = runs["ddp"][0], runs[name][0]
    assert (other.strategy, other.world_size, other.backend) == (name, 2, "gloo")
    assert other.train_losses[0] == pytest.approx(ddp.train_losses[0], abs=1e-6)
    # float32 on CPU: only the reduction order differs (all-reduce vs reduce-scatter, flat ZeRO buffers);
    # measured gaps are ~2e-7. zero++ on CPU runs without quantization (CUDA-only kernels), so the same bound holds.
    # The pipeline computes the single-process loss (one batch through the stages), which DDP's global mean equals.
    assert other.train_losses == pytest.approx(ddp.train_losses, abs=1e-5)
    assert other.eval_loss_after == pytest.approx(ddp.eval_loss_after, abs=1e-5)


def test_fast_paths_match_plain(runs):
    """The chunked loss (head and cross-entropy a chunk at a time, recomputed in backward), joined rows,
    attention example by example and the fused LoRA layers train as the plain path does: the same losses to
    float32 rounding over every step, the same eval. (zero1, zero2 and fsdp2 fuse their LoRA layers too and match
    ddp above; zero3 and zero++, whose hooks gather each module's weights as it is called, keep peft's.)"""
    fused, plain = runs["ddp"][0], runs["ddp plain"][0]
    assert re.fullmatch(r"on: \d+ adapted layers", fused.kernels["lora_fused"]), fused.kernels["lora_fused"]
    assert plain.kernels["lora_fused"] == "off"
    for name in ("zero1", "zero2", "fsdp2"):
        assert runs[name][0].kernels["lora_fused"] == fused.kernels["lora_fused"], name
    for name in ("zero3", "zero++", "pipeline"):
        assert runs[name][0].kernels["lora_fused"] == "off", name
    assert fused.kernels["fused_loss"].startswith("chunked") and plain.kernels["fused_loss"] == "off"
    assert fused.kernels["packed_attention"] == "on: causal SDPA per example"
    joined = re.fullmatch(r"on: (\d+) of (\d+) micro-batches joined into one row; .*", fused.kernels["padding_free"])
    assert joined and int(joined[1]) > 0, fused.kernels["padding_free"]
    assert plain.kernels["padding_free"] == plain.kernels["packed_attention"] == "off"
    assert fused.train_losses[0] == pytest.approx(plain.train_losses[0], abs=1e-6)
    assert fused.train_losses == pytest.approx(plain.train_losses, abs=1e-5)
    assert fused.eval_loss_after == pytest.approx(plain.eval_loss_after, abs=1e-5)
    assert fused.train_losses[-1] < fused.train_losses[0]


def test_recomputed_activations_train_as_kept_ones(runs):
    """Activation checkpointing (asked; the plan's auto keeps it off where everything fits) is applied in the
    worker, as the model itself reports, and changes no loss: recomputing a layer gives the same numbers (this run
    also computes the plain loss, which test_fast_paths_match_plain holds to the same tolerance)."""
    recomputed, kept = runs["ddp plain"], runs["ddp"]
    assert recomputed[1].plan.gradient_checkpointing and not kept[1].plan.gradient_checkpointing
    assert any(r.startswith("activation checkpointing off (auto): ") for r in kept[1].plan.reasons)
    assert recomputed[0].kernels["checkpointing"] == "activations recomputed in backward"
    assert kept[0].kernels["checkpointing"] == "off"
    assert recomputed[0].train_losses == pytest.approx(kept[0].train_losses, abs=1e-5)
    assert recomputed[0].eval_loss_after == pytest.approx(kept[0].eval_loss_after, abs=1e-5)


def pipeline_stage0_share(model_dir) -> float:
    """Share of the LoRA model's parameters that stage 0 of 2 holds: embeddings and the first half of the layers."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir)
    half = base.config.num_hidden_layers // 2
    model = get_peft_model(
        base, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", modules_to_save=["lm_head"])
    )
    mine = [f".layers.{i}." for i in range(half)] + ["embed_tokens"]
    held = sum(p.numel() for n, p in model.named_parameters() if any(m in n for m in mine))
    return held / sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    ("name", "param_share", "state_share"),
    [
        ("ddp", 1.0, None),
        ("zero1", 1.0, 0.5),
        ("zero2", 1.0, 0.5),
        ("zero3", 0.5, 0.5),
        ("zero++", 0.5, 0.5),
        ("fsdp2", 0.5, None),
        ("pipeline", "stage 0", None),
    ],
)
def test_sharding_is_real(runs, name, param_share, state_share, tiny_model):
    sharding = runs[name][0].sharding
    if param_share == "stage 0":  # the embedding and layers 0-1 of 4, with their adapters, counted on the model itself
        param_share, tolerance = pipeline_stage0_share(tiny_model), 1e-6
    else:
        tolerance = 0.01  # of 2 ranks, each holds half (DeepSpeed pads its flat buffers)
    assert sharding["parameter_share"] == pytest.approx(param_share, abs=tolerance)
    if state_share is not None:
        assert sharding["optimizer_state_share"] == pytest.approx(state_share, abs=0.01)
        assert sharding["zero_stage"] == (1 if name == "zero1" else 2 if name == "zero2" else 3)
        assert sharding["gradients_partitioned"] is (name != "zero1")
        # float32: the master partition is the parameter partition (DeepSpeed clones it otherwise)
        assert sharding["master_weights"] == "the parameter partition itself (float32 run: no second copy)"
        # gloo: ZeRO-3's parameter gathers broadcast into DeepSpeed's flat buffer, no second copy
        assert sharding["all_gather"] == ("in place" if name in ("zero3", "zero++") else "deepspeed")
    if name == "ddp":  # the gradients are views into the reducer's buckets
        assert sharding["wrapper"] == "DistributedDataParallel"
        assert sharding["gradients"] == "views into the all-reduce buckets"
    if name == "fsdp2":
        assert sharding["wrapper"] == "FSDP2" and sharding["decoder_layers_sharded"] == 4
        # neither end is ever gathered, the trained head (peft's copy of lm_head) included
        assert sharding["output_head"] == "sharded (vocabulary-parallel loss, never gathered)"
        assert sharding["input_embedding"] == "sharded (vocabulary-parallel lookup, never gathered)"
        assert sharding["all_gather"] == "in place"  # gloo: broadcasts into FSDP2's buffer, no second copy
    if name in (
        "zero3",
        "zero++",
    ):  # the frozen embedding as local rows; the trained head (modules_to_save) partitioned
        assert sharding["input_embedding"] == "local rows (vocabulary-parallel lookup, never gathered)"
        assert sharding["output_head"] == "gathered (trained (modules_to_save): ZeRO-3 partitions what it steps)"
    if name == "pipeline":  # rank 0: embedding + layers 0-1; rank 1: layers 2-3 + norm + head
        assert (sharding["stages"], sharding["schedule"], sharding["layers_on_rank0"]) == (2, "1f1b", [0, 1])
    if name == "zero++":  # one machine: hpZ off; CPU: no quantizer kernels (the plan says so)
        assert (sharding["hpz_partition_size"], sharding["quantized_weights"], sharding["quantized_gradients"]) == (
            1,
            False,
            False,
        )
        reasons = " ".join(runs[name][1].plan.reasons)
        assert "hpZ off: one machine" in reasons and "quantizer kernels are CUDA-only" in reasons


@pytest.mark.parametrize("name", SHARDED)
def test_adapter_equals_ddp_adapter_and_merges(runs, name, tiny_model, tmp_path):
    adapters = {n: load_file(f"{runs[n][0].adapter_url}/adapter_model.safetensors") for n in ("ddp", name)}
    assert adapters[name].keys() == adapters["ddp"].keys() and len(adapters[name]) > 0
    assert not any("_orig_mod" in k for k in adapters[name])
    for key, value in adapters["ddp"].items():
        torch.testing.assert_close(adapters[name][key], value, rtol=0, atol=1e-5)
    assert merge_adapter(tiny_model, runs[name][0].adapter_url, tmp_path / "merged") > 0


@pytest.mark.parametrize("name", ["fsdp2", "zero2", "zero3", "pipeline"])
def test_resume_is_exact(runs, name):
    full, spec = runs[name]
    root = storage.join(spec.run_url, "checkpoints")
    storage.remove(storage.join(step_dir(root, STEPS), "_COMPLETE"))  # the last checkpoint never completed
    resumed = launch(spec)
    assert resumed.resumed_from_step == 3
    assert resumed.train_losses == pytest.approx(full.train_losses, abs=1e-6)


def test_fsdp2_checkpoint_resumes_under_ddp_on_one_process(runs, tmp_path):
    """The strategy-neutral checkpoint is a torch distributed checkpoint of per-rank shards: FSDP2's (2 ranks,
    half of each tensor per rank) resumes under DDP on one process, which reads every shard, and the losses
    go on as DDP's own run's."""
    fsdp2, fsdp2_spec = runs["fsdp2"]
    ddp = runs["ddp"][0]
    spec = spec_for("ddp", tmp_path, "parallelism.cpu_processes=1")
    source = step_dir(storage.join(fsdp2_spec.run_url, "checkpoints"), 3)
    state = torch.load(Path(source, "state.pt"), weights_only=False)
    assert state["format"] == "dcp" and state["world_size"] == 2 and "model" not in state  # nothing gathered
    assert len(list(Path(source, "engine").glob("*.distcp"))) == 2  # one file of shards per rank
    storage.upload_dir(source, step_dir(storage.join(spec.run_url, "checkpoints"), 3))
    resumed = launch(spec)
    assert resumed.resumed_from_step == 3 and resumed.world_size == 1
    assert resumed.train_losses == pytest.approx(ddp.train_losses, abs=1e-5)
    assert resumed.train_losses[:3] == pytest.approx(fsdp2.train_losses[:3], abs=1e-6)  # carried over


@pytest.mark.parametrize("name", ["zero3", "fsdp2"])
def test_one_process_runs_sharded_strategies(runs, name, tmp_path):
    """One process (one GPU, or parallelism.cpu_processes=1) is launched without torchrun, so no process group
    exists unless the worker makes one; DeepSpeed's engine and FSDP2's device mesh need it. The one-rank run
    takes the same global batch by accumulation, so its losses are DDP's two-process ones."""
    result = launch(spec_for(name, tmp_path, "parallelism.cpu_processes=1", "training.checkpoint_every=0"))
    assert (result.strategy, result.world_size, result.backend) == (name, 1, "gloo")
    assert result.sharding["parameter_share"] == 1.0  # one rank holds every shard
    assert result.train_losses == pytest.approx(runs["ddp"][0].train_losses, abs=1e-5)


def test_native_checkpoint_refuses_another_strategy(runs, tmp_path):
    from ladle.train.run import TrainingFailed

    _, spec = runs["zero2"]
    other = spec.model_copy(
        update={
            "plan": spec.plan.model_copy(
                update={
                    "strategy": "zero1",
                    "launcher_config": {
                        **spec.plan.launcher_config,
                        "zero_optimization": {**spec.plan.launcher_config["zero_optimization"], "stage": 1},
                    },
                }
            )
        }
    )
    with pytest.raises(TrainingFailed, match=r"written by zero2 on 2 rank\(s\) \(native format\); this run is zero1"):
        launch(other)


@pytest.fixture(scope="module")
def full_runs(tmp_path_factory, tiny_model):
    """Full fine-tunes (no LoRA), 2 steps: what each sharded strategy consolidates into one model."""
    root = tmp_path_factory.mktemp("full")
    full = ("training.lora.enabled=false", "training.max_steps=2", "training.checkpoint_every=0")
    specs = {name: spec_for(name, root, *full) for name in ("ddp", "tp")}
    # Saved a 1 MiB part at a time: the sharded strategies' models come out in several files with an index.
    specs.update({name: spec_for(name, root, *full, "training.save_shard_mib=1") for name in ("zero3", "fsdp2")})
    # The pipeline's stages send their weights to rank 0 a 1 MiB part at a time as well.
    specs["pipeline"] = spec_for(
        "pipeline", root, *full, "parallelism.pipeline.schedule=gpipe", "training.save_shard_mib=1"
    )
    return launch_all(specs)


@pytest.mark.parametrize("name", ["pipeline", "tp"])
def test_gpipe_and_tensor_parallel_full_finetunes_match_ddp(full_runs, name):
    assert full_runs[name].train_losses == pytest.approx(full_runs["ddp"].train_losses, abs=1e-5)
    assert full_runs[name].eval_loss_after == pytest.approx(full_runs["ddp"].eval_loss_after, abs=1e-5)
    if name == "tp":  # the model's tp_plan splits q/k/v/o, gate/up/down, the embedding and the head over 2 ranks
        sharding = full_runs["tp"].sharding
        assert sharding["tp_degree"] == 2 and sharding["sharded_parameters"] >= 4 * 7
        assert sharding["parameter_share"] == pytest.approx(0.5, abs=0.01)  # only the norms stay whole
        config = json.loads(Path(full_runs["tp"].model_url, "config.json").read_text())
        assert "distributed_config" not in config  # the saved model loads as a plain model


@pytest.mark.parametrize("name", ["zero3", "fsdp2", "pipeline", "tp"])
def test_full_finetune_consolidates_to_the_same_safetensors(full_runs, name, tmp_path):
    from ladle.lifecycle.merge import merge

    ddp, other = full_runs["ddp"], full_runs[name]
    assert other.adapter_url is None and other.model_url
    if name == "fsdp2":  # two micro-batches a rank; on this host the unsharded float32 gradients fit (auto)
        assert other.sharding["gradient_sync"] == "last_microbatch"
    weights = {n: saved_weights(Path(r.model_url)) for n, r in (("ddp", ddp), (name, other))}
    assert weights[name].keys() == weights["ddp"].keys() and len(weights[name]) >= 30
    if name in ("zero3", "fsdp2", "pipeline"):  # streamed in 1 MiB parts, each written before the next was gathered
        index = json.loads(Path(other.model_url, "model.safetensors.index.json").read_text())
        files = sorted(Path(other.model_url).glob("model-*-of-*.safetensors"))
        assert len(files) >= 4 and set(index["weight_map"].values()) == {f.name for f in files}
        for file in files:  # at most 1 MiB of tensors, or one larger tensor alone
            tensors = load_file(file)
            assert len(tensors) == 1 or sum(t.numel() * t.element_size() for t in tensors.values()) <= 2**20
        assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in weights[name].values())
        config = json.loads(Path(other.model_url, "config.json").read_text())
        assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "float32"
        from transformers import AutoModelForCausalLM

        loaded = AutoModelForCausalLM.from_pretrained(other.model_url)  # the index, as Hugging Face reads it
        assert torch.equal(loaded.get_input_embeddings().weight, weights[name]["model.embed_tokens.weight"])
    for key, value in weights["ddp"].items():
        assert weights[name][key].shape == value.shape, key  # whole tensors, not one rank's shard
        # Sharded matmuls sum in another order (~1e-7 relative in the gradients). Adam divides by sqrt(v), so
        # where a gradient is ~0 that noise can move one element's update by a fraction of lr (3e-3): a few
        # elements in 10^5 differ by up to ~5e-5 (measured, tensor parallel); the rest agree to 1e-5.
        diff = (weights[name][key] - value).abs()
        assert float(diff.max()) < 3e-4, key  # < lr / 10
        assert float((diff > 1e-5).float().mean()) < 1e-3, key
    merged = merge(None, other, str(tmp_path))
    assert merged.parameters == sum(v.numel() for v in weights["ddp"].values())


def test_hsdp_shards_within_groups_and_matches_ddp(runs, tmp_path):
    """4 processes as 2 replica groups x 2 shards (FSDP2 on a 2-D mesh): each rank holds half the
    parameters, placed (Replicate, Shard(0)), and the losses are DDP's (same global batch). Each rank's two
    micro-batches are reduce-scattered one by one within its group, the all-reduce across the groups waiting for
    the second (``gradient_sync: each_microbatch``)."""
    spec = spec_for(
        "fsdp2",
        tmp_path,
        "parallelism.cpu_processes=4",
        "parallelism.fsdp2.replicate=2",
        "parallelism.fsdp2.gradient_sync=each_microbatch",
        "training.micro_batch_size=1",
        "training.checkpoint_every=0",
    )
    assert spec.plan.launcher_config["mesh"] == {"replicate": 2, "shard": 2}
    assert spec.plan.gradient_accumulation == 2
    # Uneven on purpose: a rank with fewer eval rows must still join every sharded forward (it once hung here).
    assert spec.dataset.eval_rows % 4 != 0
    result = launch(spec)
    assert result.world_size == 4 and result.sharding["wrapper"] == "FSDP2 (HSDP)" and result.sharding["mesh"] == [2, 2]
    assert result.sharding["gradient_sync"] == "each_microbatch"
    assert result.sharding["parameter_share"] == pytest.approx(0.5, abs=0.01)
    assert result.sharding["output_head"].startswith("gathered (kept sharded over one data-parallel dimension")
    assert result.train_losses == pytest.approx(runs["ddp"][0].train_losses, abs=1e-5)
