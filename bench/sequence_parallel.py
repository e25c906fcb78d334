"""Ulysses sequence parallelism on CPU gloo processes: the longest row a rank's memory holds, the planner's per-rank
peak against the measured one, and what the all-to-alls cost.

    .venv/bin/python bench/sequence_parallel.py [--lengths 2048 4096 8192 16384] [--steps 2]

A locally created random-init Llama (hidden 256, 4 layers, 8 heads / 4 KV heads, the demo tokenizer's 345-token
vocabulary: the decoder's activations, not the logits, grow with the row), a full fine-tune in float32, rows
packed from synthetic ~1,500-token texts, micro-batch 1 and global batch 2 for every layout:

- ``whole`` — DDP on 2 processes: each rank trains one whole row per step (sp = 1).
- ``sp=2`` — nd with sp=2 on 2 processes: both rows of a step, each split in two across the ranks
  (FSDP over the 2 ranks; 2 micro-steps).
- ``sp=4`` — nd with sp=4 on 4 processes (for the planner's figures; 4 processes on 2 cores).

For each layout and length: the largest rank's peak RSS above its baseline (the process and its libraries before
any weight), the planner's prediction for it (the memory model counts what a step adds to the process, as
``bench/nd.py`` compares it), and tokens/s. The longest trainable row at a fixed per-rank
memory comes from the measured peaks: above the baseline each is a fixed part plus a part that grows with the row
(activations; attention runs example by example, so nothing grows as its square), fitted per layout and solved for
the cap (the whole-row layout's peak at its longest measured length).

``--allocator mmap`` runs the ranks with glibc's ``MALLOC_MMAP_THRESHOLD_=65536``: every allocation above 64 KiB
is its own mapping, returned on free, so the peak RSS is what was live. By default glibc raises that threshold as
large blocks are freed and serves them from the heap, whose holes stay resident: the peak then depends on how a
run's allocations happened to interleave (a micro-step's freed activations under the next one's), which is what
a CPU run sees but not what a rank holds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import random_llama, save  # noqa: E402

SHAPE = {
    "hidden_size": 256,
    "intermediate_size": 704,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
}
LAYOUTS = {  # label: (strategy, processes, overrides)
    "whole": ("ddp", 2, []),
    "sp=2": ("nd", 2, ["parallelism.dims.sp=2"]),
    "sp=4": ("nd", 4, ["parallelism.dims.sp=4"]),
}


def long_texts(path: Path, examples: int = 200, words: int = 700) -> Path:
    """Synthetic ``text`` records of random lowercase words (~1,500 demo-tokenizer tokens each), seeded."""
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    with path.open("w") as f:
        for _ in range(examples):
            text = " ".join("".join(rng.choice(letters) for _ in range(rng.randint(2, 7))) for _ in range(words))
            f.write(json.dumps({"text": text}) + "\n")
    return path


def planned(base: Path, data: Path, label: str, length: int, steps: int):
    from ladle.config import build_config
    from ladle.machine.topology import probe
    from ladle.plan.memory import plan_estimate
    from ladle.plan.planner import make_plan

    strategy, processes, overrides = LAYOUTS[label]
    cfg = build_config(
        {
            "base": str(base),
            "data": {"path": str(data), "seq_len": length, "eval_ratio": 0.02},
            "parallelism": {"strategy": strategy, "cpu_processes": processes},
            "training": {
                "max_steps": steps,
                "lr": 1e-4,
                "micro_batch_size": 1,
                "global_batch_size": 2,
                "eval_every": 0,
                "checkpoint_every": 0,
                "gradient_checkpointing": False,
                "lora": {"enabled": False},
            },
        },
        overrides,
    )
    model_config = json.loads((base / "config.json").read_text())
    plan = make_plan(cfg, probe(env={}, query_output=""), model=model_config)
    return cfg, plan, plan_estimate(cfg, plan, model_config).peak / 2**20


def run(base: Path, data: Path, label: str, length: int, steps: int, root: Path) -> dict:
    from ladle.data.prepare import prepare
    from ladle.train.run import launch
    from ladle.train.spec import TrainSpec

    cfg, plan, predicted = planned(base, data, label, length, steps)
    dataset = prepare(cfg.data, base, str(root / f"data-{length}"))
    spec = TrainSpec(
        config=cfg, plan=plan, dataset=dataset, base_dir=str(base), run_url=str(root / f"{label}-{length}")
    )
    started = time.monotonic()
    result = launch(spec)
    return {
        "layout": label,
        "length": length,
        "mesh": plan.mesh,
        "predicted_peak_mib": predicted,
        "peak_memory_mib": result.peak_memory_mib,
        "baseline_memory_mib": result.baseline_memory_mib,
        "tokens_per_s": result.tokens_per_s,
        "first_loss": result.train_losses[0],
        "kernels": result.kernels,
        "wall_s": time.monotonic() - started,
    }


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares ``fixed + per_token x length`` through (length, MiB above the baseline)."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="*", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--sp4-lengths", type=int, nargs="*", default=[4096, 16384])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--allocator", choices=("default", "mmap"), default="default")
    args = parser.parse_args()
    if args.allocator == "mmap":
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # the ranks inherit it
    base = random_llama("sp-random-llama-v1", SHAPE)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = long_texts(root / "long.jsonl")
        plan = [(label, n) for n in args.lengths for label in ("whole", "sp=2")]
        plan += [("sp=4", n) for n in args.sp4_lengths]
        for label, length in plan:
            rows.append(run(base, data, label, length, args.steps, root))
            print(json.dumps(rows[-1]), flush=True)

    def above(r):
        return r["peak_memory_mib"] - r["baseline_memory_mib"]

    print("| layout | row tokens | peak MiB above baseline | predicted | predicted / measured | tokens/s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(
            f"| {r['layout']} | {r['length']} | {above(r):.0f} | {r['predicted_peak_mib']:.0f}"
            f" | {r['predicted_peak_mib'] / above(r):.2f} | {r['tokens_per_s']:.0f} |"
        )
    fits = {label: fit([(r["length"], above(r)) for r in rows if r["layout"] == label]) for label in ("whole", "sp=2")}
    longest = max(args.lengths)
    cap = next(above(r) for r in rows if r["layout"] == "whole" and r["length"] == longest)
    reach = {label: (cap - fixed) / slope for label, (fixed, slope) in fits.items()}
    print(
        f"\ncap {cap:.0f} MiB above baseline per rank (whole rows at {longest} tokens): longest row whole "
        f"{reach['whole']:.0f} tokens, sp=2 {reach['sp=2']:.0f} tokens: {reach['sp=2'] / reach['whole']:.2f}x; "
        f"per-token MiB whole {fits['whole'][1] * 1024:.1f}/1k, sp=2 {fits['sp=2'][1] * 1024:.1f}/1k"
    )
    speed = {
        n: next(r["tokens_per_s"] for r in rows if r["layout"] == "sp=2" and r["length"] == n)
        / next(r["tokens_per_s"] for r in rows if r["layout"] == "whole" and r["length"] == n)
        for n in args.lengths
    }
    print("tokens/s sp=2 / whole: " + ", ".join(f"{n}: {v:.2f}" for n, v in speed.items()))
    save(
        f"sequence_parallel_{args.allocator}",
        {
            "rows": rows,
            "fits": fits,
            "cap_mib": cap,
            "reach": reach,
            "speed": speed,
            "shape": SHAPE,
            "allocator": args.allocator,
        },
    )


if __name__ == "__main__":
    main()
