"""GRPO's per-rank memory: the planner's prediction against the measured peak, on the real model.

    .venv/bin/python bench/grpo_memory.py [--strategies ddp,zero3,fsdp2] [--steps 3] [--full [--beta 0.04]] [--set k=v]

SmolLM2-135M-Instruct (the shipped GGUF, float32), the GRPO recipe's prompts, rewards and settings (LoRA r=16 on
every linear layer, 8 prompts x 8 completions of up to 24 tokens per step, micro-batches of 16), 2 CPU processes,
a few steps under each strategy. The prediction is the plan's per-rank peak (``plan_estimate``: loading, the
update step, the rollouts with their KV cache and, under ZeRO-3 and FSDP2, the weights gathered whole); the measure
is the largest rank's peak resident set less its process baseline before the model loaded (bench/memory.py's
measure), as for DPO. ``--full``: a full fine-tune instead; with ``--beta`` above 0 its KL reference (a frozen
copy of the starting weights, sharded as the trained ones under ZeRO-3 and FSDP2) is held beside it.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import save, train_spec  # noqa: E402

from ladle.assets import resolve_base  # noqa: E402
from ladle.config import load_config  # noqa: E402
from ladle.machine.topology import probe  # noqa: E402
from ladle.plan.planner import plan_estimate  # noqa: E402
from ladle.train.run import launch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


FULL = ["training.lora.enabled=false", "training.lr=1e-5"]  # --full: a full fine-tune (--beta: with a reference)


def run(strategy: str, steps: int, tmp: Path, full: bool = False, beta: float = 0.0, extra: tuple = ()) -> dict:
    from ladle import rewards as reward_fns

    cfg = load_config(
        ROOT / "recipes" / "smollm2-135m-grpo-cpu.yaml",
        [
            f"parallelism.strategy={strategy}",
            f"training.max_steps={steps}",
            "training.global_batch_size=64",
            "training.checkpoint_every=0",
            f"output={tmp}",
            f"training.rl.beta={beta}",
            *(FULL if full else []),
            *extra,
        ],
    )
    resolve_base(cfg.base, "float32")
    spec = train_spec(cfg, tmp, strategy, topo=probe())
    spec = spec.model_copy(update={"reward_files": reward_fns.bundle(cfg.training.rl.rewards)})
    lengths: list[float] = []
    result = launch(
        spec, on_progress=lambda e: lengths.append(e["completion_length"]) if e["event"] == "step" else None
    )
    config = json.loads((Path(spec.base_dir) / "config.json").read_text())
    estimate = plan_estimate(spec.config, spec.plan, config)
    measured = result.peak_memory_mib - result.baseline_memory_mib
    predicted = estimate.peak / 2**20
    return {
        "strategy": strategy,
        "full_finetune": full,
        "beta": beta,
        "reference_mib": estimate.reference / 2**20,
        "peak_mib": result.peak_memory_mib,
        "above_baseline_mib": measured,
        "predicted_mib": predicted,
        "predicted_parts_mib": {
            "load": (estimate.load + estimate.context) / 2**20,
            "step": estimate.total / 2**20,
            "rollout": (estimate.states + estimate.rollout + estimate.context) / 2**20,
        },
        "measured_over_predicted": measured / predicted,
        "rollouts": result.kernels.get("rollouts"),
        "padding_free": result.kernels.get("padding_free"),
        # The plan sizes every completion at its longest; scored as one row, the update holds the real tokens only.
        "completion_fill": sum(lengths) / len(lengths) / cfg.training.rl.max_completion_tokens if lengths else None,
        "overrides": list(extra),
        "strategy_options": spec.plan.strategy_options,
        "losses": result.train_losses,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategies", default="ddp,zero3,fsdp2")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--full", action="store_true", help="a full fine-tune instead of the recipe's LoRA")
    parser.add_argument("--beta", type=float, default=0.0, help="the KL's weight (> 0: a reference is held)")
    parser.add_argument("--set", action="append", default=[], help="a config override for every run (key=value)")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for strategy in args.strategies.split(","):
            row = run(strategy, args.steps, Path(tmp) / strategy, args.full, args.beta, tuple(args.set))
            rows.append(row)
            parts = ", ".join(f"{k} {v:.0f}" for k, v in row["predicted_parts_mib"].items())
            print(
                f"{strategy:<6} measured above baseline {row['above_baseline_mib']:7.0f} MiB  predicted "
                f"{row['predicted_mib']:7.0f} MiB ({parts})  measured/predicted {row['measured_over_predicted']:.3f}  "
                f"completions {row['completion_fill']:.0%} of their longest",
                flush=True,
            )
    name = "grpo_memory_full" if args.full else "grpo_memory"
    print(
        "saved", save(name, {"steps": args.steps, "full": args.full, "beta": args.beta, "set": args.set, "rows": rows})
    )


if __name__ == "__main__":
    main()
