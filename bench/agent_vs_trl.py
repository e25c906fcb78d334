"""Peer comparison: the same multi-turn GRPO run with a tool through ladle and through TRL's GRPOTrainer.

    .venv/bin/python bench/agent_vs_trl.py [--base models:/smollm2-135m-calculator@champion]
        [--output ./runs/smollm2-135m-calculator] [--steps 4] [--reps 2]

Both sides: the calculator warm-up's champion (SmolLM2-135M-Instruct taught the Hermes call format with ladle's
ChatML tools template), the calculator questions in every phrasing (ladle://calculator-prompts), 2 questions x 8
episodes per step over 2 processes, up to 3 model turns (TRL: 2 tool-calling iterations) of at most 40 tokens, the
built-in calculator as the one tool (TRL: as its ``environment_factory``), the ``right_answer`` reward, TRL's
default loss (dapo, beta 0), LoRA r=16 on all linear layers, float32, the same ``accelerate launch``.

TRL at its best honest setting that runs here: its own generation (``model.generate``, each tool round a new
batch over the prompts and what came so far). ladle: its engine on the live adapter, every live episode's turn in
one batch. Throughput is the model's own tokens (TRL's ``completions/mean_length`` counts those too, its tool
tokens masked out) over the seconds inside steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agent_episodes import base_folder  # noqa: E402
from common import launch_grpo, launch_trl, save  # noqa: E402

from ladle.assets import resolve_builtin  # noqa: E402
from ladle.config import build_config  # noqa: E402

HERE = Path(__file__).resolve().parent
GROUP, PER_STEP, TURN, TURNS, RESULT, LR = 8, 16, 40, 3, 64, 1e-3
BUDGET = TURNS * TURN + (TURNS - 1) * RESULT  # ladle's completion_budget: TRL's max_completion_length


def ladle_config(base: str, tmp: Path, steps: int, seed: int):
    return build_config(
        {
            "base": base,
            "data": {
                "path": str(resolve_builtin("ladle://calculator-prompts", "data.path")),
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
                    "max_completion_tokens": TURN,
                    "logprob_check_every": 0,
                    "environment": "calculator",
                    "episode": {"max_turns": TURNS, "max_tool_result_tokens": RESULT},
                    "rewards": ["ladle.recipes.rewards.calculator:right_answer"],
                },
            },
        },
        [],
    )


def run_ladle(base: str, tmp: Path, steps: int, rep: int) -> dict:
    return launch_grpo(ladle_config(base, tmp, steps, rep), tmp, f"ladle-{rep}")


def run_trl(base: str, tmp: Path, steps: int, rep: int) -> dict:
    data = tmp / "prompts.jsonl"
    data.write_text(Path(resolve_builtin("ladle://calculator-prompts", "data.path")).read_text())
    ranks, wall = launch_trl(
        HERE / "trl_agent_worker.py",
        [base, str(data), str(tmp / f"trl-{rep}"), str(steps), str(PER_STEP // 2), str(GROUP), str(BUDGET),
         str(TURNS), str(LR), str(rep)],
    )  # fmt: skip
    lead = next(r for r in ranks if r["rank"] == 0)
    tokens = int(sum(length * PER_STEP for length in lead["mean_lengths"]))
    return {
        "tokens": tokens,
        "seconds": lead["seconds"],
        "tokens_per_s": tokens / lead["seconds"],
        "rewards": lead["rewards"],
        "tool_calls": lead["tool_calls"],
        "peak_mib": max(r["peak_mib"] for r in ranks),
        "wall_s": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", default="models:/smollm2-135m-calculator@champion")
    parser.add_argument("--output", default="./runs/smollm2-135m-calculator", help="where the registry of --base is")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--reps", type=int, default=1)
    args = parser.parse_args()
    base = base_folder(args.base, args.output)
    results: dict[str, list] = {"ladle": [], "trl": []}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for rep in range(args.reps):
            for side in ("ladle", "trl") if rep % 2 == 0 else ("trl", "ladle"):
                res = (run_ladle if side == "ladle" else run_trl)(base, tmp, args.steps, rep)
                results[side].append(res)
                print(
                    f"rep {rep} {side:<6} {res['tokens_per_s']:7.1f} model tok/s  {res['tokens']:6d} tokens in "
                    f"{res['seconds']:6.1f} s (wall {res['wall_s']:5.1f} s)  rewards {[round(r, 3) for r in res['rewards']]}"
                    f"  peak {res['peak_mib']:.0f} MiB/rank",
                    flush=True,
                )
    med = {s: statistics.median(r["tokens_per_s"] for r in results[s]) for s in results}
    summary = {
        "base": args.base,
        "steps": args.steps,
        "median_model_tokens_per_s": med,
        "ratio_vs_trl": med["ladle"] / med["trl"],
        "step_seconds": {s: statistics.median(r["seconds"] / args.steps for r in results[s]) for s in results},
        "rewards": {s: [r["rewards"] for r in results[s]] for s in results},
        "peak_mib_per_rank": {s: statistics.median(r["peak_mib"] for r in results[s]) for s in results},
    }
    print(json.dumps(summary, indent=2))
    save("agent_vs_trl", {"summary": summary, "runs": results})


if __name__ == "__main__":
    main()
