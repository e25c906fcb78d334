"""Peer comparison: the same LoRA GRPO run through ladle and through TRL's GRPOTrainer.

    .venv/bin/python bench/grpo_vs_trl.py [--base models:/tiny-cpu@champion] [--steps 20] [--reps 2]

The shipped online-RL recipe's task on both sides: the demo's champion (``make demo`` first), prompts of colour
lists longer than its supervised data showed (``ladle://demo-prompts``), 16 prompts x 8 completions per step over
2 processes, at most 12 completion tokens, temperature 1, two rewards (``items_in_place`` from
``ladle.recipes.rewards.colours``, called by both trainers as TRL calls a reward, and exact match), TRL's default
loss (dapo, beta 0, one update per batch), LoRA r=16 on all linear layers, a constant learning rate, float32 and no
activation checkpointing on both, the same ``accelerate launch --multi_gpu`` (gloo on CPU) and OMP_NUM_THREADS.

TRL at its best honest setting that runs here: its own generation (``model.generate`` over the step's prompts in
one batch; vLLM does not run on a CPU). ladle: its batching engine on the live adapter, in the same processes.

Throughput is completion tokens over the seconds inside steps (rollouts, rewards and update); the generation's
share is reported beside it (ladle: its engine's seconds; TRL: its ``transformers.generate`` profiling span). The
reward curves are each step's mean summed reward, compared by their last-5-step means.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import launch_grpo, launch_trl, save  # noqa: E402

from ladle.assets import resolve_builtin  # noqa: E402
from ladle.config import build_config  # noqa: E402

HERE = Path(__file__).resolve().parent
GROUP, PER_STEP, LENGTH, LR = 8, 128, 12, 3e-3


def base_folder(base: str, output: str) -> str:
    """A model folder for ``base``: a registered model resolved through ladle (as a run resolves it), or a path."""
    if not base.startswith("models:/"):
        return base
    from ladle.plan.inputs import base_dir_of, registered_version

    cfg = build_config({"base": base, "data": {"path": "ladle://demo-prompts"}, "output": output}, [])
    return str(base_dir_of(cfg, registered_version(cfg)))


def ladle_config(base: str, tmp: Path, steps: int, seed: int):
    return build_config(
        {
            "base": base,
            "data": {
                "path": str(resolve_builtin("ladle://demo-prompts", "data.path")),
                "seq_len": 64,
                "eval_ratio": 0.0,
            },
            "output": str(tmp),
            "parallelism": {"strategy": "ddp", "cpu_processes": 2},
            "training": {
                "objective": "grpo",
                "max_steps": steps,
                "lr": LR,
                "scheduler": "constant",
                "seed": seed,
                "micro_batch_size": PER_STEP // 2,
                "global_batch_size": PER_STEP,
                "lora": {"r": 16, "alpha": 32, "target_modules": "all-linear"},
                "rl": {
                    "num_generations": GROUP,
                    "max_completion_tokens": LENGTH,
                    "logprob_check_every": 0,
                    "rewards": [
                        "ladle.recipes.rewards.colours:items_in_place",
                        {"fn": "exact_match", "args": {"column": "answer"}},
                    ],
                },
            },
        },
        [],
    )


def run_ladle(base: str, tmp: Path, steps: int, rep: int) -> dict:
    return launch_grpo(ladle_config(base, tmp, steps, rep), tmp, f"ladle-{rep}")


def run_trl(base: str, tmp: Path, steps: int, rep: int) -> dict:
    data = tmp / "prompts.jsonl"
    data.write_text(Path(resolve_builtin("ladle://demo-prompts", "data.path")).read_text())
    ranks, wall = launch_trl(
        HERE / "trl_grpo_worker.py",
        [
            base,
            str(data),
            str(tmp / f"trl-{rep}"),
            str(steps),
            str(PER_STEP // 2),
            str(GROUP),
            str(LENGTH),
            str(LR),
            str(rep),
        ],
    )
    lead = next(r for r in ranks if r["rank"] == 0)
    tokens = int(sum(length * PER_STEP for length in lead["mean_lengths"]))
    return {
        "tokens": tokens,
        "seconds": lead["seconds"],
        "tokens_per_s": tokens / lead["seconds"],
        "generation_s": lead["generation_s"],
        "rewards": lead["rewards"],
        "peak_mib": max(r["peak_mib"] for r in ranks),
        "wall_s": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", default="models:/tiny-cpu@champion")
    parser.add_argument("--output", default="./runs/tiny-cpu", help="where the registry of --base is")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()
    base = base_folder(args.base, args.output)
    results: dict[str, list] = {"ladle": [], "trl": []}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for rep in range(args.reps):
            for side in ("ladle", "trl") if rep % 2 == 0 else ("trl", "ladle"):
                res = (run_ladle if side == "ladle" else run_trl)(base, tmp, args.steps, rep)
                results[side].append(res)
                last = statistics.mean(res["rewards"][-5:])
                print(
                    f"rep {rep} {side:<6} {res['tokens_per_s']:7.0f} completion tok/s  {res['tokens']:6d} tokens in "
                    f"{res['seconds']:6.1f} s (generation {res['generation_s']:5.1f} s, wall {res['wall_s']:5.1f} s)  "
                    f"reward first {res['rewards'][0]:.3f} last-5 {last:.3f}  peak {res['peak_mib']:.0f} MiB/rank",
                    flush=True,
                )
    med = {s: statistics.median(r["tokens_per_s"] for r in results[s]) for s in results}
    summary = {
        "base": args.base,
        "steps": args.steps,
        "median_completion_tokens_per_s": med,
        "ratio_vs_trl": med["ladle"] / med["trl"],
        "generation_share": {
            s: statistics.median(r["generation_s"] / r["seconds"] for r in results[s]) for s in results
        },
        "step_seconds": {s: statistics.median(r["seconds"] / args.steps for r in results[s]) for s in results},
        "reward_last5": {s: [statistics.mean(r["rewards"][-5:]) for r in results[s]] for s in results},
        "reward_first": {s: [r["rewards"][0] for r in results[s]] for s in results},
        "peak_mib_per_rank": {s: statistics.median(r["peak_mib"] for r in results[s]) for s in results},
        "wall_s": {s: statistics.median(r["wall_s"] for r in results[s]) for s in results},
    }
    print(json.dumps(summary, indent=2))
    save("grpo_vs_trl", {"summary": summary, "runs": results})


if __name__ == "__main__":
    main()
