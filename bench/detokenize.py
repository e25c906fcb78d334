"""Incremental detokenization, per generated token: tokenizers' ``DecodeStream`` (the engine's since 2026-11-28)
beside the window decode it replaced (two ``decode`` calls of a few tokens per step), on the real model's
tokenizer (SmolLM2-135M-Instruct) and the tiny one, over sampled-looking answers (words and lone bytes).

    python bench/detokenize.py [--answers 200] [--length 512]

Prints microseconds per token for each and their ratio, and checks both give the same text.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def window_decode(tokenizer, tokens: list[int]) -> str:
    """The replaced algorithm: decode a window from one decoded token back, hold a half character."""
    text, prefix_at, read_at = "", 0, 0
    for n in range(1, len(tokens) + 1):
        prefix = tokenizer.decode(tokens[prefix_at:read_at], skip_special_tokens=True)
        new = tokenizer.decode(tokens[prefix_at:n], skip_special_tokens=True)
        if len(new) > len(prefix) and not new.endswith("\ufffd"):
            text += new[len(prefix) :]
            prefix_at, read_at = read_at, n
    if read_at < len(tokens):
        prefix = tokenizer.decode(tokens[prefix_at:read_at], skip_special_tokens=True)
        text += tokenizer.decode(tokens[prefix_at:], skip_special_tokens=True)[len(prefix) :]
    return text


def stream_decode(tokenizer, tokens: list[int]) -> str:
    from ladle.serve.rows import Job, decode_next

    job, text = Job(ids=[1], max_new_tokens=len(tokens)), ""
    for token in tokens:
        job.tokens.append(token)
        text += decode_next(tokenizer, job)
    return text + decode_next(tokenizer, job, final=True)


def answers(tokenizer, count: int, length: int) -> list[list[int]]:
    rng = random.Random(0)
    lone = [i for i in range(len(tokenizer)) if tokenizer.decode([i]) == "\ufffd"][:50]
    words = tokenizer(
        "The sea is calm tonight; a haiku — 雨が降る. Add 2 and 3: 5 ✓", add_special_tokens=False
    ).input_ids
    return [[rng.choice(lone if lone and rng.random() < 0.05 else words) for _ in range(length)] for _ in range(count)]


def main() -> None:
    from transformers import AutoTokenizer

    from ladle.assets import resolve_base, tiny_model_dir

    parser = argparse.ArgumentParser()
    parser.add_argument("--answers", type=int, default=200)
    parser.add_argument("--length", type=int, default=512)
    args = parser.parse_args()
    rows = {}
    for name, path in (
        ("smollm2", resolve_base("ladle://smollm2-135m-instruct", "float32")),
        ("tiny", tiny_model_dir()),
    ):
        tokenizer = AutoTokenizer.from_pretrained(path)
        made = answers(tokenizer, args.answers, args.length)
        timing = {}
        for label, decode in (("window", window_decode), ("decode_stream", stream_decode)):
            began = time.perf_counter()
            texts = [decode(tokenizer, ids) for ids in made]
            timing[label] = (time.perf_counter() - began) / (args.answers * args.length) * 1e6
            timing[label + "_texts"] = texts
        same = timing["window_texts"] == timing["decode_stream_texts"]
        rows[name] = {
            "window_us_per_token": round(timing["window"], 2),
            "decode_stream_us_per_token": round(timing["decode_stream"], 2),
            "ratio": round(timing["decode_stream"] / timing["window"], 3),
            "same_text": same,
        }
        print(name, json.dumps(rows[name]), flush=True)


if __name__ == "__main__":
    main()
