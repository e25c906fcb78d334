"""Many adapters on one base vs one merged model: SmolLM2-135M-Instruct on CPU, float32, side by side in one run.

    .venv/bin/python bench/adapters.py [--adapters 8] [--clients 32] [--seconds 20] [--swaps 10]

1. **Throughput**: ``--clients`` clients send greedy streaming chat requests (max_tokens 32) for ``--seconds`` to
   (a) a server of one merged model, (b) a server of the base with ``--adapters`` LoRA adapters (rank 16, every
   linear layer, as ``recipes/smollm2-135m-cpu.yaml`` trains them), each client addressing one adapter in turn,
   so every batch mixes adapters. Ratio: (b) / (a) output tokens/s (goal >= 0.7).
2. **Memory**: the engine process's resident memory with every adapter loaded, less the same server with none
   loaded, per adapter, against one merged copy's weights (goal <= 5 %).
3. **Promotion to serving**: under the same traffic, ``--swaps`` times a new version of one adapter is
   registered (``POST /v1/adapters``, what a registry sync does) and the time until a request for that adapter
   is answered by it is measured; every request of the traffic must succeed.

The peer: ``transformers serve`` loads one model per process and no adapters, and no multi-adapter server
(vLLM, LoRAX) installs on this CPU-only machine; the merged-model row is the baseline a user has instead.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, save  # noqa: E402
from serve_load import PROMPTS, load, wait_up  # noqa: E402

from ladle.platform.processes import free_port, stop_process  # noqa: E402


def make_adapters(base: Path, root: Path, count: int) -> list[Path]:
    """``count`` rank-16 adapters on every linear layer, B initialised small (their answers differ from the base's
    and each other's, and stay text)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ladle.serve.adapters import write_record

    folders = []
    tokenizer = AutoTokenizer.from_pretrained(base)
    for n in range(count + 1):  # one more: the new version the swaps register
        torch.manual_seed(n)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        peft = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
        for name, tensor in peft.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(tensor, std=0.01)
        folder = root / f"a{n}"
        peft.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        write_record(folder, base, str(base))
        folders.append(folder)
    return folders


def start(argv: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    with tempfile.NamedTemporaryFile("w", suffix=".log", delete=False) as log:
        proc = subprocess.Popen([*argv, "--port", str(port)], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_up(url, proc, Path(log.name))
    return proc, url


def engine_rss(proc: subprocess.Popen) -> int:
    (engine,) = psutil.Process(proc.pid).children()
    return engine.memory_info().rss


def spread_load(url: str, names: list[str], clients: int, seconds: float, count, extra: dict | None = None) -> dict:
    """``load`` with each client addressing ``names[i % len(names)]`` (one load per name, run together)."""
    found, threads = [], []
    per = {name: sum(1 for i in range(clients) if names[i % len(names)] == name) for name in names}

    def run(name: str) -> None:
        found.append(load(url, name, per[name], seconds, count, extra))

    for name in names:
        threads.append(threading.Thread(target=run, args=(name,)))
        threads[-1].start()
    for thread in threads:
        thread.join()
    wall = max(r["wall_s"] for r in found)
    return {
        "clients": clients,
        "requests": sum(r["requests"] for r in found),
        "errors": sum(r["errors"] for r in found),
        "tokens_per_s": round(sum(r["tokens_per_s"] * r["wall_s"] for r in found) / wall, 1),
        "p50_latency_s": statistics.median(r["p50_latency_s"] for r in found),
        "p99_latency_s": max(r["p99_latency_s"] for r in found),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--swaps", type=int, default=10)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from ladle.assets import resolve_base
    from ladle.lifecycle.merge import merge_adapter

    base = resolve_base("ladle://smollm2-135m-instruct", "float32")
    tokenizer = AutoTokenizer.from_pretrained(base)

    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False).input_ids)

    # Every answer runs to max_tokens (its end-of-turn tokens never chosen): both rows generate the same tokens per
    # request, whatever each adapter would answer.
    ends = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")}
    full = {"logit_bias": {str(token): -100 for token in ends if token is not None}}

    root = Path(tempfile.mkdtemp(prefix="ladle-bench-adapters-"))
    folders = make_adapters(base, root, args.adapters)
    merged = root / "merged"
    merge_adapter(base, folders[0], merged)
    merged_bytes = sum(f.stat().st_size for f in merged.glob("*.safetensors"))
    adapter_bytes = folders[0].joinpath("adapter_model.safetensors").stat().st_size
    serve = [sys.executable, "-m", "ladle.serve", "--name", "base", "--option", f"max_batch={args.clients}"]
    result = {"machine": machine(), "adapters": args.adapters, "clients": args.clients, "seconds": args.seconds}

    proc, url = start([*serve, "--model", str(merged)])
    try:
        load(url, "base", 4, 3, count)  # warm
        result["merged"] = load(url, "base", args.clients, args.seconds, count, full)
    finally:
        stop_process(proc, grace_s=10)

    names = [f"a{n}" for n in range(args.adapters)]
    items = [arg for n in range(args.adapters) for arg in ("--adapter", f"a{n}={folders[n]}")]
    option = ["--option", f"max_adapters={args.adapters}"]
    proc, url = start([*serve, "--model", str(base), *items, *option])
    try:
        load(url, "base", 4, 3, count)  # warm, the base only: no adapter loaded yet
        bare = engine_rss(proc)
        spread_load(url, names, args.adapters, 3, count)  # every adapter loaded
        loaded = engine_rss(proc)
        result["adapters_row"] = spread_load(url, names, args.clients, args.seconds, count, full)
        result["memory"] = {
            "merged_weights_mib": round(merged_bytes / 2**20, 1),
            "adapter_file_mib": round(adapter_bytes / 2**20, 2),
            "engine_rss_no_adapter_mib": round(bare / 2**20, 1),
            "engine_rss_all_loaded_mib": round(loaded / 2**20, 1),
            "per_adapter_mib": round((loaded - bare) / args.adapters / 2**20, 2),
            "per_adapter_vs_merged": round((loaded - bare) / args.adapters / merged_bytes, 4),
        }
        swaps, failures = [], []
        stop = threading.Event()

        def traffic(name: str) -> None:
            with httpx.Client(timeout=120) as http:
                while not stop.is_set():
                    body = {"model": name, "prompt": PROMPTS[0], "max_tokens": 16, "temperature": 0}
                    reply = http.post(f"{url}/v1/completions", json=body)
                    if reply.status_code != 200:
                        failures.append(reply.text[:200])

        threads = [threading.Thread(target=traffic, args=(names[i % len(names)],)) for i in range(args.clients)]
        for thread in threads:
            thread.start()
        try:
            for n in range(args.swaps):
                new = folders[-1] if n % 2 == 0 else folders[0]
                began = time.monotonic()
                added = httpx.post(
                    f"{url}/v1/adapters", json={"name": "a0", "path": str(new), "version": str(n + 2)}, timeout=60
                )
                added.raise_for_status()
                body = {"model": f"a0@{n + 2}", "prompt": PROMPTS[1], "max_tokens": 1, "temperature": 0}
                reply = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
                reply.raise_for_status()
                swaps.append(time.monotonic() - began)
                httpx.delete(f"{url}/v1/adapters/a0", params={"version": str(n + 1)}, timeout=30)
        finally:
            stop.set()
            for thread in threads:
                thread.join()
        swaps.sort()
        result["swap"] = {
            "swaps": len(swaps),
            "p50_s": round(statistics.median(swaps), 3),
            "p99_s": round(swaps[min(len(swaps) - 1, int(0.99 * len(swaps)))], 3),
            "failed_requests": len(failures),
        }
    finally:
        stop_process(proc, grace_s=10)
    result["ratio_tokens_per_s"] = round(result["adapters_row"]["tokens_per_s"] / result["merged"]["tokens_per_s"], 3)
    print(json.dumps(result, indent=1))
    save("adapters", result)


if __name__ == "__main__":
    main()
