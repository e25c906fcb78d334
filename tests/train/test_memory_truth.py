"""Memory truth on CPU: a locally created 0.5 GB random Llama (float32 weights dominate each process), LoRA,
1 step on 2 gloo processes under ddp, fsdp2 and zero3; resident memory read from each rank.

The 1.5 GB model and the full fine-tunes are measured by ``bench/memory.py`` (bench/RESULTS.md); this keeps
the proof in the suite at a third of that size.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import launch_all, train_spec

pytestmark = pytest.mark.pipeline
SHAPE = {
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "vocab_size": 32000,
}


@pytest.fixture(scope="module")
def mid_runs(tmp_path_factory, tiny_model):
    from ladle.assets.demo import write_random_llama
    from ladle.config import build_config

    root = tmp_path_factory.mktemp("memory")
    base = write_random_llama(root / "mid-llama", tiny_model, shard_mb=100, **SHAPE)
    specs = {}
    for strategy in ("ddp", "fsdp2", "zero3"):
        cfg = build_config(
            {
                "base": str(base),
                "data": {"path": "ladle://demo-alpaca", "seq_len": 64, "eval_ratio": 0.01},
                "parallelism": {"strategy": strategy},
                "training": {
                    "max_steps": 1,
                    "micro_batch_size": 1,
                    "global_batch_size": 2,
                    "checkpoint_every": 0,
                    "lora": {"target_modules": "all-linear", "modules_to_save": []},
                },
            },
            [],
        )
        specs[strategy] = train_spec(cfg, Path(root), strategy)
    return launch_all(specs), specs


def above_baseline(result, field: str) -> float:
    return getattr(result, field) - result.baseline_memory_mib


def test_sharded_loading_holds_half_the_weights_and_trains_the_same(mid_runs):
    results, specs = mid_runs
    ddp = results["ddp"]
    weights_mib = 124_668_672 * 4 / 2**20  # 125M float32 parameters
    shard_mib = max(f.stat().st_size for f in Path(specs["ddp"].base_dir).glob("*.safetensors")) / 2**20
    for name in ("fsdp2", "zero3"):
        other = results[name]
        assert other.train_losses == pytest.approx(ddp.train_losses, abs=1e-5)
        assert other.eval_loss_before == pytest.approx(ddp.eval_loss_before, abs=1e-5)
        assert other.sharding["parameter_share"] == pytest.approx(0.5, abs=0.01)
        # Loaded and wrapped, below DDP's, which holds all the weights (plus its broadcast).
        assert other.load_peak_memory_mib < 0.75 * ddp.load_peak_memory_mib, (name, other, ddp)
    # Each sharded rank's load: at most 1.2x its half of the weights plus one checkpoint shard file. Measured
    # 263 MiB for FSDP2 and 358 MiB for ZeRO-3 (DeepSpeed's engine included) against a bound of 379; before
    # reads went straight into their destinations and ZeRO-3 freed its ends' partitions at once, 319 and 459.
    for name in ("fsdp2", "zero3"):
        load = above_baseline(results[name], "load_peak_memory_mib")
        assert load < 1.2 * weights_mib / 2 + shard_mib, (name, load, weights_mib, shard_mib)
    assert above_baseline(ddp, "load_peak_memory_mib") > weights_mib
    # Neither end is ever gathered: FSDP2 and ZeRO-3 (whose LoRA run holds the frozen ends as local rows) both
    # look up and compute the loss vocabulary-parallel.
    for name, held in (("fsdp2", "sharded"), ("zero3", "local rows")):
        assert results[name].sharding["input_embedding"] == f"{held} (vocabulary-parallel lookup, never gathered)"
        assert results[name].sharding["output_head"] == f"{held} (vocabulary-parallel loss, never gathered)"
    # The whole-run peaks (load, eval and the step), asserted near what they reach so a regression fails:
    # measured 0.62x DDP's for FSDP2 and 0.75x for ZeRO-3 (0.83x with its ends gathered); the 1.5 GB model's
    # are in bench/RESULTS.md.
    assert results["fsdp2"].peak_memory_mib < 0.7 * ddp.peak_memory_mib
    assert results["zero3"].peak_memory_mib < 0.8 * ddp.peak_memory_mib


def test_planner_predicts_the_measured_peak(mid_runs):
    """The planner's per-rank figure for this CPU host, against the measured peak less the process baseline."""
    import json

    from ladle.plan.planner import plan_estimate

    results, specs = mid_runs
    # ZeRO-3's prediction counts DeepSpeed's engine on a CPU host (ENGINE_HOST_BYTES); the full fine-tunes
    # are checked by the bench (bench/RESULTS.md), where the rows are too large for the suite.
    # Measured over predicted: DDP 1.05, FSDP2 1.09-1.10, ZeRO-3 1.12-1.16 on one 2-core host (idle and busy)
    # and 1.19 on another. ZeRO-3's CPU excess is there from its first eval (each rank's resident set 30-60 MiB
    # above the step's prediction before any step), heap that ZeRO-3's per-module hooks and gathers leave on a
    # CPU rank and that varies with the host's allocator; a GPU run counts the CUDA allocator, which has none of
    # it. So ZeRO-3 on CPU is held to "never over, at most 25 % under", the others to 15 % either way.
    bounds = {"ddp": (0.85, 1.15), "fsdp2": (0.85, 1.15), "zero3": (0.95, 1.25)}
    for name, (low, high) in bounds.items():
        spec, result = specs[name], results[name]
        model = json.loads((Path(spec.base_dir) / "config.json").read_text())
        est = plan_estimate(spec.config, spec.plan, model)
        measured = above_baseline(result, "peak_memory_mib") * 2**20
        assert low * est.peak <= measured <= high * est.peak, (name, measured / est.peak, est.summary(), measured)
