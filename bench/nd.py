"""N-D parallelism on 4 CPU gloo processes: tokens/s and per-rank peak memory of each mesh, relative to DDP.

    .venv/bin/python bench/nd.py [--steps 10] [--reps 2] [--meshes "pp=2 × tp=2" ...]

A locally created random-init Llama (hidden 512, 8 layers, 8 heads / 4 KV heads, vocab 32 000: 56M parameters,
225 MB of float32 weights; nothing downloaded), a full fine-tune (tensor parallelism excludes LoRA), packed
128-token rows, micro-batch 1 and global batch 4 for every mesh (DDP: 4 replicas x 1; a mesh with 2
data-parallel replicas accumulates 2 micro-batches, a pipeline runs them as 2 microbatches). The meshes
alternate order between repetitions; medians are reported. On CPU every collective is a gloo round trip over
loopback and the 4 processes share 2 cores, so what this shows is communication and memory, not speed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import random_llama, save  # noqa: E402

SHAPE = {
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "vocab_size": 32000,
}
MESHES = {
    "ddp": ("ddp", []),
    "fsdp2": ("fsdp2", []),
    "dp_shard=2 × tp=2": ("nd", ["parallelism.dims.tp=2"]),
    "tp=4": ("nd", ["parallelism.dims.tp=4"]),
    "pp=2 × dp_shard=2": ("nd", ["parallelism.dims.pp=2"]),
    "pp=2 × dp_replicate=2": ("nd", ["parallelism.dims.pp=2", "parallelism.dims.dp_replicate=2"]),
    "pp=2 × tp=2": ("nd", ["parallelism.dims.pp=2", "parallelism.dims.tp=2"]),
}


def mid_model() -> Path:
    return random_llama("mid-random-llama-v1", SHAPE)


def planned(base: Path, label: str, steps: int):
    """The config, the plan for this CPU host, and the planner's per-rank peak for it (MiB)."""
    from ladle.config import build_config
    from ladle.machine.topology import probe
    from ladle.plan.planner import make_plan, plan_estimate

    strategy, overrides = MESHES[label]
    cfg = build_config(
        {
            "base": str(base),
            "data": {"path": "ladle://demo-alpaca", "seq_len": 128},
            "parallelism": {"strategy": strategy, "cpu_processes": 4},
            "training": {
                "max_steps": steps,
                "lr": 1e-4,
                "micro_batch_size": 1,
                "global_batch_size": 4,
                "eval_every": 0,
                "checkpoint_every": 0,
                "lora": {"enabled": False},
            },
        },
        overrides,
    )
    model_config = json.loads((base / "config.json").read_text())
    plan = make_plan(cfg, probe(env={}, query_output=""), model=model_config)
    return cfg, plan, plan_estimate(cfg, plan, model_config).peak / 2**20


def run(base: Path, label: str, steps: int, root: Path) -> dict:
    from ladle.data.prepare import prepare
    from ladle.train.run import launch
    from ladle.train.spec import TrainSpec

    cfg, plan, predicted = planned(base, label, steps)
    dataset = prepare(cfg.data, base, str(root))
    spec = TrainSpec(config=cfg, plan=plan, dataset=dataset, base_dir=str(base), run_url=str(root / label))
    result = launch(spec)
    return {
        "mesh": label,
        "strategy": plan.strategy,
        "predicted_peak_mib": predicted,
        "tokens_per_s": result.tokens_per_s,
        "peak_memory_mib": result.peak_memory_mib,
        "baseline_memory_mib": result.baseline_memory_mib,
        "parameter_share": result.sharding.get("parameter_share"),
        "first_loss": result.train_losses[0],
        "last_loss": result.train_losses[-1],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--meshes", nargs="*", default=list(MESHES), help="a subset of the meshes (ddp always runs)")
    args = parser.parse_args()
    base = mid_model()
    labels = ["ddp", *(m for m in args.meshes if m != "ddp")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for label in labels if rep % 2 == 0 else list(reversed(labels)):
                row = run(base, label, args.steps, Path(tmp) / f"rep{rep}")
                rows.append({**row, "rep": rep})
                print(json.dumps(rows[-1]), flush=True)
    med = {
        label: {
            key: statistics.median(r[key] for r in rows if r["mesh"] == label)
            for key in ("tokens_per_s", "peak_memory_mib", "baseline_memory_mib")
        }
        for label in labels
    }
    ddp = med["ddp"]
    print(
        "| mesh | tokens/s | vs DDP | peak MiB (largest rank) | above baseline | vs DDP | predicted | "
        "predicted / above baseline | parameter share | first loss |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for label in labels:
        m, first = med[label], next(r for r in rows if r["mesh"] == label)
        above, ddp_above = (
            m["peak_memory_mib"] - m["baseline_memory_mib"],
            ddp["peak_memory_mib"] - ddp["baseline_memory_mib"],
        )
        print(
            f"| {label} | {m['tokens_per_s']:.0f} | {m['tokens_per_s'] / ddp['tokens_per_s']:.2f} | "
            f"{m['peak_memory_mib']:.0f} | {above:.0f} | {above / ddp_above:.2f} | {first['predicted_peak_mib']:.0f} | "
            f"{first['predicted_peak_mib'] / above:.2f} | {first['parameter_share']:.3f} | {first['first_loss']:.6f} |"
        )
    save("nd", {"rows": rows, "medians": med, "steps": args.steps, "shape": SHAPE})


if __name__ == "__main__":
    main()
