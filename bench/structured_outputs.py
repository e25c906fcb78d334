"""What structured outputs cost: one ladle server (transformers backend, batched) with half of its clients asking
for a JSON schema beside free ones, against the same server with every client free, side by side in one run; and
the grammar libraries' compile and mask times on the served model's vocabulary.

    .venv/bin/python bench/structured_outputs.py [--model DIR] [--seconds 10] [--clients 32]

Default model: SmolLM2-135M-Instruct (49,152-token vocabulary), CPU, float32. Every answer is 32 tokens: the
schema's one string field must be at least 400 characters long, so a constrained answer is still inside it when
``max_tokens`` ends it, and every request biases the end-of-sequence token by -100 (the grammar is never
complete, so it never forces the end). The constrained rows are masked at every token.

The library figures: each available library (llguidance, which ladle uses; xgrammar where installed, e.g.
``pip install --no-deps xgrammar apache-tvm-ffi``) builds its view of the tokenizer, compiles a 4-property schema
and computes the mask before every token of a 32-token answer.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve_load  # noqa: E402
from common import save  # noqa: E402

from ladle.platform.processes import stop_process  # noqa: E402

LONG = {
    "type": "json_schema",
    "json_schema": {
        "name": "summary",
        "schema": {
            "type": "object",
            "properties": {"summary": {"type": "string", "minLength": 400}},
            "required": ["summary"],
            "additionalProperties": False,
        },
    },
}
SMALL = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "kind": {"enum": ["a", "b", "c"]},
    },
    "required": ["name", "age", "tags", "kind"],
    "additionalProperties": False,
}


def libraries(tokenizer) -> list[dict]:
    """Each installed grammar library's tokenizer build, schema compile and per-token mask times."""
    answer = json.dumps({"name": "Ada Lovelace", "age": 36, "tags": ["math", "engines", "poetry"], "kind": "b"})
    ids = tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]
    vocab, rows = len(tokenizer), []
    import llguidance
    import llguidance.hf
    import llguidance.torch

    began = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tokenizer, vocab)
    built = time.perf_counter() - began
    compiles, masks = [], []
    for _ in range(5):
        began = time.perf_counter()
        matcher = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(SMALL))
        compiles.append(time.perf_counter() - began)
    mask = llguidance.torch.allocate_token_bitmask(1, vocab)
    for token in ids:
        began = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask(matcher, mask, 0)
        masks.append(time.perf_counter() - began)
        matcher.consume_token(token)
    rows.append(row("llguidance", built, compiles, masks))
    try:
        import xgrammar
    except ImportError:
        return rows
    began = time.perf_counter()
    compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab))
    built = time.perf_counter() - began
    compiles, masks = [], []
    for n in range(5):
        began = time.perf_counter()
        # a different schema text each time: xgrammar caches compiled grammars by their text
        compiled = compiler.compile_json_schema(json.dumps({**SMALL, "title": f"t{n}"}))
        compiles.append(time.perf_counter() - began)
    matcher, bitmask = xgrammar.GrammarMatcher(compiled), xgrammar.allocate_token_bitmask(1, vocab)
    for token in ids:
        began = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask)
        masks.append(time.perf_counter() - began)
        matcher.accept_token(token)
    rows.append(row("xgrammar", built, compiles, masks))
    return rows


def row(name: str, built: float, compiles: list[float], masks: list[float]) -> dict:
    return {
        "library": name,
        "tokenizer_ms": round(built * 1000, 1),
        "compile_ms_median": round(statistics.median(compiles) * 1000, 2),
        "mask_us_median": round(statistics.median(masks) * 1e6, 1),
        "mask_us_max": round(max(masks) * 1e6, 1),
    }


def mixed(url: str, clients: int, seconds: float, count, bias: dict) -> dict:
    """Half the clients constrained, half free, at once; tokens/s of all of them together."""
    out: dict = {}

    def run(key: str, body: dict) -> None:
        out[key] = serve_load.load(url, "m", clients // 2, seconds, count, body)

    threads = [
        threading.Thread(target=run, args=("free", {"logit_bias": bias})),
        threading.Thread(target=run, args=("constrained", {"logit_bias": bias, "response_format": LONG})),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {
        "clients": clients,
        "tokens_per_s": round(out["free"]["tokens_per_s"] + out["constrained"]["tokens_per_s"], 1),
        "errors": out["free"]["errors"] + out["constrained"]["errors"],
        "free_p50_latency_s": out["free"]["p50_latency_s"],
        "constrained_p50_latency_s": out["constrained"]["p50_latency_s"],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()
    from ladle.assets import resolve_base

    model = args.model or resolve_base("ladle://smollm2-135m-instruct", "float32")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    libs = libraries(tokenizer)
    for lib in libs:
        print(json.dumps(lib), flush=True)

    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False).input_ids)

    proc, url = serve_load.start_ladle(model, max_batch=32)
    rows = []
    bias = {str(tokenizer.eos_token_id): -100.0}
    try:
        serve_load.load(url, "m", 2, 2.0, count, {"logit_bias": bias, "response_format": LONG})  # warm up
        for rep in range(args.reps):  # alternate the order between repetitions
            for setting in ("free", "half constrained") if rep % 2 == 0 else ("half constrained", "free"):
                if setting == "free":
                    got = serve_load.load(url, "m", args.clients, args.seconds, count, {"logit_bias": bias})
                    got = {k: got[k] for k in ("clients", "tokens_per_s", "errors", "p50_latency_s")}
                else:
                    got = mixed(url, args.clients, args.seconds, count, bias)
                rows.append({"setting": setting, "rep": rep, **got})
                print(json.dumps(rows[-1]), flush=True)
    finally:
        stop_process(proc, grace_s=10)
    med = {
        s: statistics.median(r["tokens_per_s"] for r in rows if r["setting"] == s) for s in ("free", "half constrained")
    }
    ratio = med["half constrained"] / med["free"]
    print(f"tokens/s at {args.clients} clients: free {med['free']:.1f}, half constrained {med['half constrained']:.1f}")
    print(f"half constrained / free: {ratio:.3f}")
    print(
        f"results: {save('structured_outputs', {'model': str(model), 'libraries': libs, 'rows': rows, 'ratio': ratio})}"
    )


if __name__ == "__main__":
    main()
