"""A 3-source mix (data.sources): peak memory at 1M rows against 100k, and throughput against TRL's preparation
of the same sources mixed by ``datasets.interleave_datasets``.

    .venv/bin/pip install -c constraints.txt -e ".[bench]"   # trl, datasets
    .venv/bin/python bench/prepare_mix.py [--small 100000] [--large 1000000] [--trl-rows 100000]

The sources, in their native shapes: instructions (alpaca, weight 5), chats (ShareGPT, weight 3) and a rehearsal
set of messages (a tenth of the rows, 2 epochs). Each ladle measurement is a fresh ``ladle data prepare`` process
whose peak RSS comes from the kernel (``ru_maxrss`` of a one-child wrapper); if the mix streams, the peak at 1M
rows stays that at 100k. Throughput: the same three sources as conversational prompt/completion rows for TRL,
``load_dataset`` per source, ``interleave_datasets`` with the same shares (``first_exhausted``, seeded) plus the
rehearsal set concatenated twice, then ``SFTTrainer._prepare_dataset`` (bfd packing, completion-only loss), single
process like ladle; tokens per second of packed output on each side. The two sides alternate.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import save  # noqa: E402
from prepare_memory import peak_rss_mib  # noqa: E402
from prepare_vs_trl import trl_trainer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHARES = {"own": 5, "public": 3}  # weights; the rehearsal set: epochs 2


def write_sources(folder: Path, rows: int) -> dict[str, Path]:
    """Three files in their own shapes (alpaca, ShareGPT, messages) holding ``rows`` records together, and the
    same records as prompt/completion rows for TRL. Every record is distinct."""
    from ladle.assets.demo import demo_rows

    block = demo_rows(n=10_000, seed=3)
    sizes = {"own": rows * 5 // 10, "public": rows * 4 // 10, "rehearsal": rows // 10}
    files = {}
    for name, n in sizes.items():
        ladle_file, trl_file = folder / f"{name}.jsonl", folder / f"{name}-trl.jsonl"
        with ladle_file.open("w") as a, trl_file.open("w") as b:
            for i in range(n):
                r = block[i % len(block)]
                prompt = f"{r['instruction']}\n{r['input']} {name} {i}".strip()
                if name == "own":
                    row = {"instruction": r["instruction"], "input": f"{r['input']} {name} {i}", "output": r["output"]}
                elif name == "public":
                    row = {"conversations": [{"from": "human", "value": prompt}, {"from": "gpt", "value": r["output"]}]}
                else:
                    row = {
                        "messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": r["output"]}]
                    }
                a.write(json.dumps(row) + "\n")
                user = [{"role": "user", "content": prompt}]
                b.write(
                    json.dumps({"prompt": user, "completion": [{"role": "assistant", "content": r["output"]}]}) + "\n"
                )
        files[name], files[f"{name}-trl"] = ladle_file, trl_file
    return files


def config_for(folder: Path, files: dict[str, Path], seq_len: int) -> Path:
    recipe = yaml.safe_load((ROOT / "recipes" / "tiny-cpu.yaml").read_text())
    recipe["data"] = {
        "sources": [
            {"path": str(files["own"]), "weight": SHARES["own"]},
            {"path": str(files["public"]), "weight": SHARES["public"], "format": "sharegpt"},
            {"path": str(files["rehearsal"]), "epochs": 2},
        ],
        "seq_len": seq_len,
        "eval_ratio": 0.0,
    }
    path = folder / "mix.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def run_ladle(config: Path, out: Path) -> dict:
    ladle = str(Path(sys.executable).with_name("ladle"))
    argv = [ladle, "data", "prepare", str(config), "--json", "--set", f"output={out}"]
    rss, wall = peak_rss_mib(argv)
    done = subprocess.run(argv, check=True, capture_output=True, text=True)  # found prepared: reads the report
    report = json.loads(done.stdout[done.stdout.index("{") :])
    return {
        "wall_s": wall,
        "peak_rss_mib": rss,
        "tokens": report["tokens_total"],
        "examples": report["train_examples"],
        "tokens_per_s": report["tokens_total"] / wall,
        "mix": [{k: m[k] for k in ("name", "asked_share", "achieved_share", "train_examples")} for m in report["mix"]],
    }


def run_trl(files: dict[str, Path], trainer, tokenizer, args, cache: Path) -> dict:
    from datasets import concatenate_datasets, interleave_datasets, load_dataset

    began = time.perf_counter()
    load = lambda name: load_dataset(  # noqa: E731
        "json", data_files=str(files[f"{name}-trl"]), split="train", cache_dir=str(cache / f"hf-{time.time_ns()}")
    )
    own, public, rehearsal = load("own"), load("public"), load("rehearsal")
    total = sum(SHARES.values())
    mixed = interleave_datasets(
        [own, public],
        probabilities=[SHARES["own"] / total, SHARES["public"] / total],
        seed=0,
        stopping_strategy="first_exhausted",
    )
    dataset = concatenate_datasets([mixed, rehearsal, rehearsal]).shuffle(seed=0)
    packed = trainer._prepare_dataset(
        dataset, tokenizer, args, packing=True, formatting_func=None, dataset_name="train"
    )
    wall = time.perf_counter() - began
    tokens = sum(len(ids) for ids in packed["input_ids"])
    return {"wall_s": wall, "tokens": tokens, "examples": len(dataset), "tokens_per_s": tokens / wall}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", type=int, default=100_000)
    parser.add_argument("--large", type=int, default=1_000_000)
    parser.add_argument("--trl-rows", type=int, default=100_000, help="Rows of the throughput comparison.")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()
    results: dict = {"memory": {}, "throughput": {"ladle": [], "trl": []}}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for name, rows in (("small", args.small), ("large", args.large)):
            folder = tmp / name
            folder.mkdir()
            files = write_sources(folder, rows)
            res = run_ladle(config_for(folder, files, args.seq_len), folder / "out")
            results["memory"][name] = {"rows": rows, **res}
            print(
                f"ladle mix {name:<5} {rows:>9,} rows  peak RSS {res['peak_rss_mib']:7.1f} MiB  {res['wall_s']:6.1f} s"
                f"  {res['tokens_per_s']:8.0f} tok/s  mix {res['mix']}",
                flush=True,
            )
        folder = tmp / "small"
        files = {k: folder / f"{k}.jsonl" for k in ("own", "public", "rehearsal")}
        files |= {f"{k}-trl": folder / f"{k}-trl.jsonl" for k in ("own", "public", "rehearsal")}
        if args.trl_rows != args.small:
            folder = tmp / "trl"
            folder.mkdir()
            files = write_sources(folder, args.trl_rows)
        config = config_for(folder, files, args.seq_len)
        trainer, tokenizer, sft_args = trl_trainer(args.seq_len, tmp)
        for rep in range(args.reps):
            for side in ("ladle", "trl") if rep % 2 == 0 else ("trl", "ladle"):
                if side == "ladle":
                    res = run_ladle(config, folder / f"out-{rep}")
                else:
                    res = run_trl(files, trainer, tokenizer, sft_args, tmp)
                results["throughput"][side].append(res)
                print(f"rep {rep} {side:<5} {res['wall_s']:7.2f} s {res['tokens_per_s']:9.0f} tok/s", flush=True)
    growth = results["memory"]["large"]["peak_rss_mib"] / results["memory"]["small"]["peak_rss_mib"]
    med = {s: statistics.median(r["tokens_per_s"] for r in results["throughput"][s]) for s in ("ladle", "trl")}
    ratio = med["ladle"] / med["trl"]
    print(f"rows grew {args.large / args.small:.0f}x; ladle's peak RSS grew {growth:.3f}x")
    print(f"throughput (median tokens/s): ladle {med['ladle']:.0f}, trl {med['trl']:.0f}, ratio {ratio:.2f}")
    print("saved", save("prepare_mix", {**results, "rss_growth": growth, "median_tokens_per_s": med, "ratio": ratio}))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
