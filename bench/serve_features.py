"""What the per-request serving features cost: one ladle server (transformers backend, batched) under the same
concurrent greedy streaming load, plain and with each feature asked by every request, side by side in one run.

    .venv/bin/python bench/serve_features.py [--model DIR] [--seconds 8] [--levels 1,8]

Default model: SmolLM2-135M-Instruct (its 49,152-token vocabulary is what log_softmax, top-k and the penalties
work over; the tiny demo model's is 512). CPU, float32. Reported per setting and concurrency: output tokens/s
and the ratio to plain in the same run, and p50 latency. Every request, plain included, biases the end-of-sequence
token by -100, so every answer is 32 tokens whatever the setting (otherwise a setting that changes the answers
changes how much of the time is prefill).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve_load  # noqa: E402
from common import save  # noqa: E402

from ladle.platform.processes import stop_process  # noqa: E402

SETTINGS = {
    "plain": {},
    "logprobs, top 5": {"logprobs": True, "top_logprobs": 5},
    "penalties (presence, frequency, repetition)": {
        "presence_penalty": 0.5,
        "frequency_penalty": 0.5,
        "repetition_penalty": 1.2,
    },
    "logit_bias (16 tokens)": {"logit_bias": {str(t): -5.0 for t in range(100, 116)}},
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--levels", default="1,8")
    args = parser.parse_args()
    from ladle.assets import resolve_base

    model = args.model or resolve_base("ladle://smollm2-135m-instruct", "float32")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)

    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False).input_ids)

    proc, url = serve_load.start_ladle(model, max_batch=32)
    rows = []
    try:
        for name, extra in SETTINGS.items():
            bias = {**extra.get("logit_bias", {}), str(tokenizer.eos_token_id): -100.0}
            body = {**extra, "logit_bias": bias}
            serve_load.load(url, "m", 2, 2.0, count, body)  # warm up
            for clients in [int(x) for x in args.levels.split(",")]:
                row = {"setting": name, **serve_load.load(url, "m", clients, args.seconds, count, body)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        stop_process(proc, grace_s=10)
    plain = {r["clients"]: r["tokens_per_s"] for r in rows if r["setting"] == "plain"}
    for row in rows:
        row["vs_plain"] = round(row["tokens_per_s"] / plain[row["clients"]], 3) if plain.get(row["clients"]) else None
    print(f"results: {save('serve_features', {'model': str(model), 'rows': rows})}")
    for row in rows:
        print(f"{row['setting']:46s} {row['clients']:3d} clients  {row['tokens_per_s']:8.1f} tok/s  x{row['vs_plain']}")


if __name__ == "__main__":
    main()
