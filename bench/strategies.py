"""Per-strategy training throughput and peak memory on this machine, relative to DDP.

    .venv/bin/python bench/strategies.py [--steps 60] [--reps 2] [--full]

Same model, data, seed and global batch for every strategy; 2 gloo processes
on CPU (or the visible GPUs); the strategies alternate. Reported: real
(non-padding) tokens/s measured by the worker over its steps, and the largest
per-rank peak memory (RSS on CPU, CUDA allocator peak on GPUs).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import save, train_spec  # noqa: E402

from ladle.config import build_config  # noqa: E402
from ladle.machine.topology import probe  # noqa: E402
from ladle.strategies import REGISTRY  # noqa: E402
from ladle.train.run import launch  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument(
        "--full", action="store_true", help="full fine-tune instead of LoRA (adds tp, which LoRA excludes)"
    )
    args = parser.parse_args()
    # nd composes degrees (bench/nd.py, 4 processes); with none set it is fsdp2 on 2 processes.
    names = [n for n in sorted(REGISTRY, key=lambda n: n != "ddp") if (args.full or n != "tp") and n != "nd"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for name in names if rep % 2 == 0 else list(reversed(names)):
                cfg = build_config(
                    {
                        "base": "ladle://tiny-llama",
                        "data": {"path": "ladle://demo-alpaca"},
                        "output": tmp,
                        "parallelism": {"strategy": name, "pipeline": {"allow_cpu": True}},
                        "training": {
                            "max_steps": args.steps,
                            "lr": 3e-3 if not args.full else 1e-3,
                            "checkpoint_every": 0,
                            "global_batch_size": 8,
                            "lora": {
                                "enabled": not args.full,
                                "r": 16,
                                "target_modules": "all-linear",
                                "modules_to_save": ["lm_head", "embed_tokens"],
                            },
                        },
                    },
                    [],
                )
                spec = train_spec(cfg, Path(tmp), f"runs/{name}-{rep}", topo=probe())
                result = launch(spec)
                rows.append(
                    {
                        "strategy": name,
                        "rep": rep,
                        "tokens_per_s": result.tokens_per_s,
                        "peak_memory_mib": result.peak_memory_mib,
                        "parameter_share": result.sharding.get("parameter_share"),
                    }
                )
                print(
                    f"rep {rep} {name:<6} {result.tokens_per_s:8.0f} tok/s  peak {result.peak_memory_mib:7.1f} MiB",
                    flush=True,
                )
    med = {
        n: {k: statistics.median(r[k] for r in rows if r["strategy"] == n) for k in ("tokens_per_s", "peak_memory_mib")}
        for n in names
    }
    print(f"\n{'strategy':<9}{'tok/s':>9}{'vs ddp':>8}{'peak MiB':>10}{'vs ddp':>8}")
    for n in names:
        m = med[n]
        print(
            f"{n:<9}{m['tokens_per_s']:>9.0f}{m['tokens_per_s'] / med['ddp']['tokens_per_s']:>8.2f}"
            f"{m['peak_memory_mib']:>10.1f}{m['peak_memory_mib'] / med['ddp']['peak_memory_mib']:>8.2f}"
        )
    print(
        "saved",
        save("strategies-full" if args.full else "strategies", {"steps": args.steps, "rows": rows, "median": med}),
    )


if __name__ == "__main__":
    main()
