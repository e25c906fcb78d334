"""The transformers backend's engine against its previous version, side by side in one process: the cache rebuilt
through ``DynamicCache``'s constructor (sliding windows correct under joins, a KV budget) vs the old hand-spliced
layers, on the demo's tiny model on the CPU.

    .venv/bin/python bench/engine_cache.py [--baseline d4e86b9] [--rounds 5]

64 requests (prompts of 2-32 words, 16-64 new tokens, EOS ignored) are submitted at once to each engine (batch 32),
the two alternating for ``--rounds``; reported: each one's median tokens/s, their ratio, and whether every answer
is the same (greedy).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import save  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def baseline_engine(commit: str):
    source = subprocess.run(
        ["git", "show", f"{commit}:ladle/serve/engine.py"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    path = Path(tempfile.mkdtemp()) / "engine_baseline.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("engine_baseline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["engine_baseline"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def run(module, engine, tokenizer, prompts) -> tuple[float, list[tuple[int, ...]]]:
    done, jobs = threading.Semaphore(0), []
    began = time.perf_counter()
    for i, prompt in enumerate(prompts):
        job = module.Job(
            ids=tokenizer(prompt).input_ids,
            max_new_tokens=16 + (i % 4) * 16,
            emit=lambda kind, data: kind != "text" and done.release(),
        )
        jobs.append(job)
        engine.submit(job)
    for _ in prompts:
        done.acquire()
    return sum(len(j.tokens) for j in jobs) / (time.perf_counter() - began), [tuple(j.tokens) for j in jobs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="d4e86b9", help="commit whose engine is the baseline")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ladle.assets import tiny_model_dir
    from ladle.serve import engine as current

    old = baseline_engine(args.baseline)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir())
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir()).eval()
    model.generation_config.eos_token_id = None
    prompts = [f"question {i} " + "word " * (i % 7 * 5) for i in range(64)]
    engines = {
        "baseline": (old, old.Engine(model, tokenizer, "cpu", 32)),
        "current": (current, current.Engine(model, tokenizer, "cpu", 32)),
    }
    rates: dict[str, list[float]] = {name: [] for name in engines}
    answers = {}
    for _ in range(args.rounds):
        for name, (module, engine) in engines.items():
            rate, answers[name] = run(module, engine, tokenizer, prompts)
            rates[name].append(rate)
    result = {name: round(statistics.median(values), 1) for name, values in rates.items()}
    result["ratio"] = round(result["current"] / result["baseline"], 3)
    result["same_answers"] = answers["baseline"] == answers["current"]
    print(result)
    save("engine_cache", {"baseline_commit": args.baseline, **result})


if __name__ == "__main__":
    main()
