"""Peer comparison: the same LoRA DPO run through ladle and through TRL's DPOTrainer.

    .venv/bin/python bench/dpo_vs_trl.py [--model smollm2|tiny] [--steps 30] [--reps 2]

The same preference pairs (the demo's colour tasks, the right answer chosen and a wrong or chattering one
rejected: ``ladle.assets.demo.preference_rows``, 1,200 pairs), as conversational prompt/chosen/rejected turns
that both render through the model's chat template; sequence length 64 per side (TRL's ``max_length``),
DPO's sigmoid loss at beta 0.1, LoRA r=16 on all linear layers (the tiny random-init model also trains its
embeddings and head), 4 pairs per process per step, 2 processes under the same ``accelerate launch
--multi_gpu`` (gloo on CPU) and OMP_NUM_THREADS, float32 and no activation checkpointing on both sides (what
ladle's plan chose on this host). Both sides count real tokens the same way: every non-padding token of both
sides of each pair, the prompt twice.

TRL at its best honest settings: its padding-free mode is unavailable in 1.16 (it warns and pads), so it runs
twice, with the reference computed per step (its default) and precomputed before training
(``precompute_ref_log_probs``), and the faster counts. ladle runs its defaults (the reference precomputed before
the first step, padding-free micro-batches, the chunked head). Throughput is real tokens over the seconds
inside optimizer steps; the wall time of each whole run (start-up, reference pass, steps) is reported beside it.
Peak memory: the largest resident set of a rank. The planner's prediction: its per-rank step figure against the
measured peak less the process's baseline (bench/memory.py's measure).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import launch_trl, save, train_spec  # noqa: E402

from ladle.assets import resolve_base, tiny_model_dir  # noqa: E402
from ladle.assets.demo import demo_rows, preference_rows  # noqa: E402
from ladle.config import build_config  # noqa: E402
from ladle.machine.topology import probe  # noqa: E402
from ladle.plan.planner import plan_estimate  # noqa: E402
from ladle.train.run import launch  # noqa: E402

HERE = Path(__file__).resolve().parent
SEQ_LEN = 64
MODELS = {
    # name: (base, lr, trained ends)
    "tiny": (lambda: str(tiny_model_dir()), 3e-3, ["lm_head", "embed_tokens"]),
    "smollm2": (lambda: str(resolve_base("ladle://smollm2-135m-instruct", "float32")), 5e-4, []),
}


def write_pairs(tmp: Path, count: int) -> tuple[Path, Path]:
    """The pairs as ladle reads them (prompt string, chosen and rejected strings) and as TRL's conversational
    form (the same turns as lists of messages)."""
    rows = preference_rows(demo_rows(count))
    plain, chat = tmp / "pairs.jsonl", tmp / "pairs-chat.jsonl"
    plain.write_text("".join(json.dumps(r) + "\n" for r in rows))
    conversational = [
        {
            "prompt": [{"role": "user", "content": r["prompt"]}],
            "chosen": [{"role": "assistant", "content": r["chosen"]}],
            "rejected": [{"role": "assistant", "content": r["rejected"]}],
        }
        for r in rows
    ]
    chat.write_text("".join(json.dumps(r) + "\n" for r in conversational))
    return plain, chat


def ladle_config(pairs: Path, tmp: Path, steps: int, model: str):
    base, lr, ends = MODELS[model]
    return build_config(
        {
            "base": base(),
            "data": {"path": str(pairs), "seq_len": SEQ_LEN, "eval_ratio": 0.0},
            "output": str(tmp),
            "parallelism": {"strategy": "ddp", "cpu_processes": 2},
            "training": {
                "objective": "dpo",
                "max_steps": steps,
                "lr": lr,
                "micro_batch_size": 4,
                "warmup_steps": 3,
                "checkpoint_every": 0,
                "lora": {"r": 16, "alpha": 32, "target_modules": "all-linear", "modules_to_save": ends},
            },
        },
        [],
    )


def run_ladle(pairs: Path, tmp: Path, steps: int, rep: int, model: str) -> dict:
    spec = train_spec(ladle_config(pairs, tmp, steps, model), tmp, f"ladle-{rep}", topo=probe())
    began = time.perf_counter()
    result = launch(spec)
    wall = time.perf_counter() - began
    config = json.loads((Path(spec.base_dir) / "config.json").read_text())
    predicted = plan_estimate(spec.config, spec.plan, config).peak / 2**20
    return {
        "tokens": result.real_tokens,
        "seconds": result.train_seconds,
        "tokens_per_s": result.tokens_per_s,
        "losses": result.train_losses,
        "train_loss": result.train_loss_last,
        "peak_mib": result.peak_memory_mib,
        "above_baseline_mib": result.peak_memory_mib - result.baseline_memory_mib,
        "predicted_mib": predicted,
        "wall_s": wall,
        "reference": result.kernels.get("reference"),
    }


def run_trl(chat: Path, tmp: Path, steps: int, rep: int, model: str, precompute: bool) -> dict:
    base, lr, ends = MODELS[model]
    ranks, wall = launch_trl(
        HERE / "trl_dpo_worker.py",
        [
            base(),
            str(chat),
            str(tmp / f"trl-{rep}-{precompute}"),
            str(steps),
            "4",
            str(SEQ_LEN),
            str(lr),
            str(precompute).lower(),
            ",".join(ends) or "none",
        ],
    )
    lead = next(r for r in ranks if r["rank"] == 0)
    return {**lead, "peak_mib": max(r["peak_mib"] for r in ranks), "wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--pairs", type=int, default=1200)
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    args = parser.parse_args()
    results: dict[str, list] = {"ladle": [], "trl": [], "trl-precomputed": []}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        pairs, chat = write_pairs(tmp, args.pairs)
        for rep in range(args.reps):
            sides = tuple(results) if rep % 2 == 0 else tuple(reversed(results))
            for side in sides:
                if side == "ladle":
                    res = run_ladle(pairs, tmp, args.steps, rep, args.model)
                else:
                    res = run_trl(chat, tmp, args.steps, rep, args.model, side == "trl-precomputed")
                results[side].append(res)
                print(
                    f"rep {rep} {side:<16} {res['tokens_per_s']:8.0f} real tok/s  {res['tokens']:7d} tokens in "
                    f"{res['seconds']:6.1f} s (wall {res['wall_s']:5.1f} s)  first/last loss "
                    f"{res['losses'][0]:.4f}/{res['train_loss']:.4f}  peak {res['peak_mib']:.0f} MiB/rank",
                    flush=True,
                )
    med = {s: statistics.median(r["tokens_per_s"] for r in results[s]) for s in results}
    best = max(("trl", "trl-precomputed"), key=lambda s: med[s])
    ladle = results["ladle"][-1]
    summary = {
        "model": args.model,
        "steps": args.steps,
        "median_tokens_per_s": med,
        "trl_best": best,
        "ratio_vs_trl_best": med["ladle"] / med[best],
        "wall_s": {s: statistics.median(r["wall_s"] for r in results[s]) for s in results},
        "peak_mib_per_rank": {s: statistics.median(r["peak_mib"] for r in results[s]) for s in results},
        "final_loss": {s: [r["train_loss"] for r in results[s]] for s in results},
        "planner": {
            "predicted_mib": ladle["predicted_mib"],
            "measured_above_baseline_mib": ladle["above_baseline_mib"],
            "measured_over_predicted": ladle["above_baseline_mib"] / ladle["predicted_mib"],
        },
    }
    print(json.dumps(summary, indent=2))
    save(f"dpo_vs_trl_{args.model}", {"summary": summary, "runs": results})


if __name__ == "__main__":
    main()
