"""Peer comparison: the same LoRA SFT run through ladle and through TRL's SFTTrainer.

    .venv/bin/pip install -c constraints.txt -e ".[bench]"   # trl, datasets
    .venv/bin/python bench/train_vs_trl.py [--steps 60] [--reps 2]
    .venv/bin/python bench/train_vs_trl.py --model smollm2 --steps 20   # the real pretrained model

`--model smollm2`: SmolLM2-135M-Instruct (ladle://smollm2-135m-instruct, converted from its GGUF file), as
recipes/smollm2-135m-cpu.yaml trains it: sequence length 128, lr 1e-3, LoRA r=16 on all linear layers,
embeddings and head frozen (pretrained). Everything else as below.

Same tiny model, the same records (ladle reads them as alpaca rows, TRL as
conversational prompt/completion, the shape it masks to the completion), loss
on the response only, LoRA r=16 on all linear layers with trained embeddings and
head, sequence length 256, 4 packed rows per process per step, 2 processes
under the same `accelerate launch --multi_gpu` (gloo on CPU) and the same
OMP_NUM_THREADS, at the precision and activation checkpointing ladle's plan
chose (float32, none on a CPU host: TRL's own defaults, bf16 and checkpointing,
would run it ~10x slower on a CPU without native bf16, a ratio that measures the
defaults, not the trainers). TRL runs with packing in both of its strategies and the
faster one counts as TRL's best: `bfd` (best-fit decreasing, padding-free: each
batch becomes one long row with position ids reset per example) and `wrapped`
(fixed 256-token rows, examples cut at row ends). Throughput is real
(non-padding) tokens over the seconds spent in optimizer steps, on both
sides. The sides alternate. ladle runs four ways: its defaults, with peft's own LoRA layers
(`training.kernels.lora_fused=false`), without padding-free micro-batches
(`training.kernels.padding_free=false`), and also without attention
example by example (`packed_attention=false`: masked SDPA over whole padded rows).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import save, train_spec  # noqa: E402
from prepare_vs_trl import write_inputs  # noqa: E402

from ladle.assets import resolve_base, tiny_model_dir  # noqa: E402
from ladle.config import build_config  # noqa: E402
from ladle.machine.topology import probe  # noqa: E402
from ladle.plan.planner import make_plan  # noqa: E402
from ladle.train.run import free_port, launch  # noqa: E402

HERE = Path(__file__).resolve().parent


MODELS = {
    # name: (base, seq_len, lr, trained ends)
    "tiny": (lambda: str(tiny_model_dir()), 256, 3e-3, ["lm_head", "embed_tokens"]),
    "smollm2": (lambda: str(resolve_base("ladle://smollm2-135m-instruct", "float32")), 128, 1e-3, []),
}


# ladle's sides: its defaults, then without padding-free micro-batches, then also without attention example by
# example (masked SDPA over whole padded rows, the step before either).
LADLE_SIDES = {
    "ladle": {},
    "ladle-peft": {"lora_fused": False},
    "ladle-padded": {"padding_free": False},
    "ladle-masked": {"padding_free": False, "packed_attention": False},
}


def ladle_config(alpaca: Path, tmp: Path, steps: int, model: str = "tiny", kernels: dict | None = None):
    base, seq_len, lr, ends = MODELS[model]
    return build_config(
        {
            "base": base(),
            "data": {"path": str(alpaca), "format": "alpaca", "seq_len": seq_len, "eval_ratio": 0.0},
            "output": str(tmp),
            "parallelism": {"strategy": "ddp", "cpu_processes": 2},
            "training": {
                "max_steps": steps,
                "lr": lr,
                "micro_batch_size": 4,
                "warmup_steps": 5,
                "checkpoint_every": 0,
                "lora": {"r": 16, "alpha": 32, "target_modules": "all-linear", "modules_to_save": ends},
                "kernels": kernels or {},
            },
        },
        [],
    )


def run_ladle(alpaca: Path, tmp: Path, steps: int, rep: int, model: str, side: str = "ladle") -> dict:
    cfg = ladle_config(alpaca, tmp, steps, model, LADLE_SIDES[side])
    spec = train_spec(cfg, tmp, f"{side}-{rep}", topo=probe())
    result = launch(spec)
    return {
        "tokens": result.real_tokens,
        "seconds": result.train_seconds,
        "tokens_per_s": result.tokens_per_s,
        "train_loss": result.train_loss_last,
        "padding_free": result.kernels.get("padding_free"),
        "packed_attention": result.kernels.get("packed_attention"),
    }


def run_trl(
    prompt_completion: Path,
    tmp: Path,
    steps: int,
    rep: int,
    dtype: str,
    checkpointing: bool,
    packing: str = "bfd",
    model: str = "tiny",
) -> dict:
    base, seq_len, lr, ends = MODELS[model]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // 2)), "TOKENIZERS_PARALLELISM": "false"}
    argv = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--machine_rank",
        "0",
        "--main_process_ip",
        "127.0.0.1",
        "--main_process_port",
        str(free_port()),
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        str(HERE / "trl_sft_worker.py"),
        base(),
        str(prompt_completion),
        str(tmp / f"trl-{rep}"),
        str(steps),
        "4",
        str(seq_len),
        str(lr),
        packing,
        dtype,
        str(checkpointing).lower(),
        ",".join(ends) or "none",
    ]
    done = subprocess.run(argv, capture_output=True, text=True, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("TRL_RESULT ")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"TRL run failed ({done.returncode}):\n{(done.stdout + done.stderr)[-4000:]}")
    return json.loads(lines[-1].removeprefix("TRL_RESULT "))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--records", type=int, default=4000)
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    args = parser.parse_args()
    results = {**{side: [] for side in LADLE_SIDES}, "trl-bfd": [], "trl-wrapped": []}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        alpaca, prompt_completion = write_inputs(tmp, args.records)
        cfg = ladle_config(alpaca, tmp, args.steps, args.model)
        planned = make_plan(cfg, probe())
        dtype, checkpointing = planned.dtype, planned.gradient_checkpointing
        print(f"precision {dtype}, activation checkpointing {checkpointing}, on both sides")
        for rep in range(args.reps):
            sides = tuple(results)
            for side in sides if rep % 2 == 0 else tuple(reversed(sides)):
                if side.startswith("ladle"):
                    res = run_ladle(alpaca, tmp, args.steps, rep, args.model, side)
                else:
                    res = run_trl(
                        prompt_completion,
                        tmp,
                        args.steps,
                        rep,
                        dtype,
                        checkpointing,
                        side.removeprefix("trl-"),
                        args.model,
                    )
                results[side].append(res)
                print(
                    f"rep {rep} {side:<5} {res['tokens_per_s']:9.0f} real tok/s  {res['tokens']:8d} tokens in "
                    f"{res['seconds']:6.2f} s  last loss {res['train_loss']}"
                    + (
                        f"  padding-free {res['padding_free']}; attention by example {res['packed_attention']}"
                        if side.startswith("ladle")
                        else ""
                    ),
                    flush=True,
                )
    med = {s: statistics.median(r["tokens_per_s"] for r in results[s]) for s in results}
    best = max(("trl-bfd", "trl-wrapped"), key=lambda s: med[s])
    ratio = med["ladle"] / med[best]
    print(
        f"\nmedian real tokens/s: ladle {med['ladle']:.0f} (peft's LoRA layers {med['ladle-peft']:.0f}, padded rows "
        f"{med['ladle-padded']:.0f}, masked attention "
        f"over padded rows {med['ladle-masked']:.0f}), TRL bfd "
        f"{med['trl-bfd']:.0f}, TRL wrapped {med['trl-wrapped']:.0f}; ratio ladle / TRL's best ({best}) {ratio:.2f}"
    )
    print(
        "saved",
        save(
            "train_vs_trl" if args.model == "tiny" else f"train_vs_trl_{args.model}",
            {
                "model": args.model,
                "steps": args.steps,
                "records": args.records,
                "results": results,
                "median": med,
                "ratio": ratio,
                "dtype": dtype,
                "gradient_checkpointing": checkpointing,
            },
        ),
    )


if __name__ == "__main__":
    main()
