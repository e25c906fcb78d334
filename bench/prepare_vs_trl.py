"""Prepare throughput and packing efficiency: ladle vs TRL's SFT data preparation, same data and tokenizer.

    .venv/bin/pip install -c constraints.txt -e ".[bench]"   # trl, datasets
    .venv/bin/python bench/prepare_vs_trl.py [--rows 100000] [--seq-len 256]

Both sides start from a JSONL file on disk in their native shape (ladle:
alpaca rows; TRL: conversational prompt/completion rows, the shape for which
it masks the prompt), with the same tiny tokenizer and chat template, the loss
on the response only, single process, packing to seq_len with best/first-fit
decreasing. Timed: file to packed, tokenized rows. The two sides alternate.
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
from common import save  # noqa: E402

from ladle.assets import tiny_model_dir  # noqa: E402
from ladle.assets.demo import demo_rows  # noqa: E402
from ladle.config import DataConfig  # noqa: E402
from ladle.data.prepare import prepare  # noqa: E402


def write_inputs(folder: Path, rows: int) -> tuple[Path, Path]:
    data = demo_rows(n=rows, seed=7)
    ladle_file, trl_file = folder / "alpaca.jsonl", folder / "prompt_completion.jsonl"
    with ladle_file.open("w") as a, trl_file.open("w") as b:
        for r in data:
            a.write(json.dumps(r) + "\n")
            prompt = f"{r['instruction']}\n{r['input']}" if r["input"] else r["instruction"]
            b.write(
                json.dumps(
                    {
                        "prompt": [{"role": "user", "content": prompt}],
                        "completion": [{"role": "assistant", "content": r["output"]}],
                    }
                )
                + "\n"
            )
    return ladle_file, trl_file


def run_ladle(path: Path, out: Path, seq_len: int) -> dict:
    began = time.perf_counter()
    prepared = prepare(DataConfig(path=str(path), seq_len=seq_len, eval_ratio=0.0), tiny_model_dir(), str(out))
    wall = time.perf_counter() - began
    report = prepared.report
    return {
        "wall_s": wall,
        "tokens": report.tokens_total,
        "rows": report.train_rows,
        "packing_efficiency": report.packing_efficiency,
        "tokens_per_s": report.tokens_total / wall,
    }


def trl_trainer(seq_len: int, cache: Path):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir())
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir())
    args = SFTConfig(
        output_dir=str(cache / "trl"),
        max_length=seq_len,
        packing=True,
        packing_strategy="bfd",
        completion_only_loss=True,
        dataset_num_proc=None,
        report_to=[],
        use_cpu=True,
    )
    seed = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "assistant", "content": "yo"}]}]
    )
    return SFTTrainer(model=model, args=args, train_dataset=seed, processing_class=tokenizer), tokenizer, args


def run_trl(path: Path, seq_len: int, trainer, tokenizer, args, cache: Path) -> dict:
    from datasets import load_dataset

    began = time.perf_counter()
    dataset = load_dataset("json", data_files=str(path), split="train", cache_dir=str(cache / f"hf-{time.time_ns()}"))
    packed = trainer._prepare_dataset(
        dataset, tokenizer, args, packing=True, formatting_func=None, dataset_name="train"
    )
    wall = time.perf_counter() - began
    lengths = [len(ids) for ids in packed["input_ids"]]
    tokens = sum(lengths)
    return {
        "wall_s": wall,
        "tokens": tokens,
        "rows": len(lengths),
        "packing_efficiency": round(tokens / (len(lengths) * seq_len), 4),
        "tokens_per_s": tokens / wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()
    results = {"ladle": [], "trl": []}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        ladle_file, trl_file = write_inputs(tmp, args.rows)
        trainer, tokenizer, sft_args = trl_trainer(args.seq_len, tmp)
        for rep in range(args.reps):
            for side in ("ladle", "trl") if rep % 2 == 0 else ("trl", "ladle"):
                if side == "ladle":
                    res = run_ladle(ladle_file, tmp / f"out-{rep}", args.seq_len)
                else:
                    res = run_trl(trl_file, args.seq_len, trainer, tokenizer, sft_args, tmp)
                results[side].append(res)
                print(
                    f"rep {rep} {side:<5} {res['wall_s']:7.2f} s {res['tokens_per_s']:10.0f} tok/s "
                    f"rows {res['rows']:6d} packing {res['packing_efficiency']:.4f}",
                    flush=True,
                )
    med = {s: {k: statistics.median(r[k] for r in results[s]) for k in results[s][0]} for s in results}
    ratio = med["ladle"]["tokens_per_s"] / med["trl"]["tokens_per_s"]
    print(f"\n{'':<6}{'tok/s':>10}{'wall s':>9}{'tokens':>11}{'rows':>8}{'packing':>9}")
    for side in ("ladle", "trl"):
        m = med[side]
        print(
            f"{side:<6}{m['tokens_per_s']:>10.0f}{m['wall_s']:>9.2f}{m['tokens']:>11.0f}{m['rows']:>8.0f}{m['packing_efficiency']:>9.4f}"
        )
    print(f"ratio ladle/trl tokens/s: {ratio:.2f}")
    print(
        "saved",
        save(
            "prepare_vs_trl",
            {"rows": args.rows, "seq_len": args.seq_len, "results": results, "median": med, "ratio": ratio},
        ),
    )


if __name__ == "__main__":
    main()
