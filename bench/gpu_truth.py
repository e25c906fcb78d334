"""GPU truth: ladle's CUDA paths on one real GPU, with the memory model and a throughput anchor beside them.

    python bench/gpu_truth.py [--phases strategies,throughput,serve] [--serve-model DIR] [--out DIR]
    python bench/gpu_truth.py --summary OUT/gpu_truth.json ...      # one line per recorded row

bench/gpu_truth.sh runs it on a bare GPU machine, beside ``pytest -m gpu``.

Phases (each one's rows are written to ``OUT/gpu_truth.json`` as soon as they exist, so a run cut short
keeps what it measured):

- ``strategies``: each strategy that runs on one GPU trains a few steps of a locally created random-init
  Llama (0.73B parameters, bf16, seq 512, packed) through ``launch``, the planner's real CUDA plan for the
  GPU it finds: ddp, zero1/2/3, zero++, fsdp2 with and without per-block compile, QLoRA (nf4 base) under
  ddp and under fsdp2. Per row: the strategy that ran, the worker's sharding/engine checks, the losses, and
  the memory model's per-rank peak (less the CUDA context, which ``max_memory_allocated`` does not count)
  against ``torch.cuda.max_memory_allocated``.
- ``throughput``: a Llama-3-8B-shaped LoRA fine-tune (random init, seq 4096, bf16, packed, micro-batch 1,
  all-linear rank 16) through the same ``launch``: the median step's tokens/s after two warm-up steps, and
  MFU: FLOPs per token (4 x the matmul weights, as the frozen base needs no weight gradients, plus causal
  attention) times tokens/s over the GPU's dense bf16 peak. Anchor: NeMo Automodel, Llama-3-8B LoRA on 1 x H100 at seq 4096: 12,473 tokens/s.
- ``serve``: ladle's server (transformers backend) on ``--serve-model`` on the GPU: its greedy answer
  against offline ``generate`` on the same weights, and output tokens/s at 1, 8 and 32 concurrent clients.

Needs CUDA: it exits non-zero with the reason on a host without a GPU.
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
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.memory import SHAPES, config_for  # noqa: E402

MIB = 2**20
# Llama-3-8B's shape (random init; nothing is downloaded).
LLAMA3_8B = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
}
# Dense bf16 peak of the card (datasheet, without sparsity): H100 SXM and H200 share the same tensor cores.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12}
NEMO_ANCHOR_TOKENS_PER_S = 12473

STRATEGY_ROWS = [
    # (label, strategy, lora, overrides); the memory model's three configs first
    ("ddp lora", "ddp", True, []),
    ("zero3 full", "zero3", False, []),
    ("qlora ddp", "ddp", True, ["training.quantization.mode=nf4"]),
    ("fsdp2 lora", "fsdp2", True, []),
    ("fsdp2+compile lora", "fsdp2", True, ["parallelism.fsdp2.compile=true"]),
    ("qlora fsdp2", "fsdp2", True, ["training.quantization.mode=nf4"]),
    ("zero1 lora", "zero1", True, []),
    ("zero2 lora", "zero2", True, []),
    ("zero++ lora", "zero++", True, []),
    ("fsdp2 full", "fsdp2", False, []),
]


class Recorder:
    """Rows by phase, rewritten to one JSON file after every row."""

    def __init__(self, path: Path, header: dict) -> None:
        self.path, self.data = path, {**header, "phases": {}}
        self.flush()

    def add(self, phase: str, row: dict) -> None:
        self.data["phases"].setdefault(phase, []).append(row)
        self.flush()
        print(json.dumps({"phase": phase, **{k: v for k, v in row.items() if k != "trace"}}), flush=True)

    def flush(self) -> None:
        self.path.write_text(json.dumps(self.data, indent=1, default=str))


def header() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    import torch

    versions = {}
    for name in ("torch", "transformers", "accelerate", "peft", "deepspeed", "bitsandbytes", "tokenizers"):
        try:
            versions[name] = version(name)
        except PackageNotFoundError as exc:  # recorded, not fatal: the row that needs it fails and says so
            versions[name] = f"missing: {exc!r}"
    props = torch.cuda.get_device_properties(0)
    return {
        "device": props.name,
        "device_memory_mib": props.total_memory // MIB,
        "cuda": torch.version.cuda,
        "versions": versions,
        "date": time.strftime("%Y-%m-%d"),
        "cpus": os.cpu_count(),
    }


def plan_for(cfg, model_config: dict):
    from ladle.machine.topology import probe
    from ladle.plan.planner import make_plan

    return make_plan(cfg, probe(), model=model_config)


def train_row(label: str, base: Path, root: Path, cfg, steps_skip: int = 1) -> dict:
    """Plan on this GPU, train through ``launch``, and set the memory model beside the measured peak."""
    from ladle.data.prepare import prepare
    from ladle.plan.planner import plan_estimate
    from ladle.train.run import launch
    from ladle.train.spec import TrainSpec

    model_config = json.loads((base / "config.json").read_text())
    plan = plan_for(cfg, model_config)
    dataset = prepare(cfg.data, base, str(root / "data"), objective=cfg.training.objective)
    spec = TrainSpec(
        config=cfg, plan=plan, dataset=dataset, base_dir=str(base), run_url=str(root / label.replace(" ", "-"))
    )
    steps: list[dict] = []
    began = time.perf_counter()
    result = launch(spec, on_progress=lambda e: steps.append(e) if e.get("event") == "step" else None)
    wall = time.perf_counter() - began
    est = plan_estimate(cfg, plan, model_config)
    steady = [e["tokens_per_s"] for e in steps[steps_skip:]] or [result.tokens_per_s]
    predicted = (est.peak - est.context) / MIB
    return {
        "label": label,
        "strategy": result.strategy,
        "world_size": result.world_size,
        "backend": result.backend,
        "dtype": plan.dtype,
        "weights_dtype": result.weights_dtype,
        "micro_batch": plan.micro_batch_size,
        "seq_len": cfg.data.seq_len,
        "loss_first": result.train_loss_first,
        "loss_last": result.train_loss_last,
        "eval_before": result.eval_loss_before,
        "eval_after": result.eval_loss_after,
        "learned": result.eval_loss_after < result.eval_loss_before,
        "sharding": result.sharding,
        "kernels": result.kernels,
        "plan_kernels": plan.kernels,
        "measured_peak_mib": round(result.peak_memory_mib, 1),
        "measured_load_mib": round(result.load_peak_memory_mib, 1),
        "predicted_peak_mib": round(predicted, 1),
        "predicted_load_mib": round(est.load / MIB, 1),
        "predicted_over_measured": round(predicted / result.peak_memory_mib, 3) if result.peak_memory_mib else None,
        "breakdown": est.summary(),
        "median_step_tokens_per_s": round(statistics.median(steady), 1),
        "step_tokens_per_s": [e["tokens_per_s"] for e in steps],
        "wall_s": round(wall, 1),
        "warnings": plan.warnings,
        "reasons": plan.reasons,
        "launcher_config": plan.launcher_config,
    }


def phase_strategies(rec: Recorder, root: Path, only: set[str] | None) -> None:
    from bench.common import random_llama

    base = random_llama(*SHAPES["large"])
    for label, strategy, lora, overrides in STRATEGY_ROWS:
        if only and label not in only:
            continue
        sets = [
            "parallelism.gpus=1",
            "training.dtype=bfloat16",
            "data.seq_len=512",
            "training.micro_batch_size=2",
            "training.global_batch_size=4",
            "training.max_steps=4",
            *overrides,
        ]
        try:
            cfg = config_for(base, strategy, lora, sets)
            rec.add("strategies", train_row(label, base, root / "s", cfg))
        except Exception as exc:  # noqa: BLE001 - each row's failure is a result to record and fix
            rec.add("strategies", {"label": label, "failed": f"{type(exc).__name__}: {exc}"[-3000:]})


def write_8b(path: Path) -> Path:
    """A Llama-3-8B-shaped random model in bf16 (initialised on the GPU, saved in 5 GB shards) with the demo
    tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from ladle.assets import tiny_model_dir

    if (path / "config.json").exists():
        return path
    config = LlamaConfig(**LLAMA3_8B, max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        torch.set_default_dtype(torch.bfloat16)
        model = LlamaForCausalLM(config)
        torch.set_default_dtype(torch.float32)
    model.save_pretrained(path, safe_serialization=True, max_shard_size="5GB")
    AutoTokenizer.from_pretrained(tiny_model_dir()).save_pretrained(path)
    del model
    torch.cuda.empty_cache()
    return path


def phase_throughput(rec: Recorder, root: Path, steps: int) -> None:
    import random

    import torch
    from transformers import AutoTokenizer

    from ladle.config import build_config

    t = time.perf_counter()
    base = write_8b(root / "llama3-8b-random")
    made_s = time.perf_counter() - t
    vocab = len(AutoTokenizer.from_pretrained(base))
    rng = random.Random(0)
    data = root / "tokens.jsonl"
    # 1024-token examples: four fill each packed 4096-token row exactly.
    with data.open("w") as f:
        for _ in range(4 * (steps + 4)):
            f.write(json.dumps({"input_ids": [rng.randrange(3, vocab) for _ in range(1024)]}) + "\n")
    cfg = build_config(
        {
            "base": str(base),
            "data": {"path": str(data), "format": "tokenized", "seq_len": 4096, "eval_ratio": 0.05},
            "parallelism": {"strategy": "ddp", "gpus": 1},
            "training": {
                "max_steps": steps,
                "micro_batch_size": 1,
                "global_batch_size": 1,
                "dtype": "bfloat16",
                "eval_every": 0,
                "checkpoint_every": 0,
                "lora": {"enabled": True, "r": 16, "target_modules": "all-linear", "modules_to_save": []},
            },
        },
        [],
    )
    row = train_row("llama3-8b lora seq4096", base, root / "t", cfg, steps_skip=2)
    h, kv = LLAMA3_8B["hidden_size"], LLAMA3_8B["num_key_value_heads"] * LLAMA3_8B["head_dim"]
    layer = 2 * h * h + 2 * h * kv + 3 * h * LLAMA3_8B["intermediate_size"]
    params = LLAMA3_8B["num_hidden_layers"] * layer + h * LLAMA3_8B["vocab_size"]  # matmul weights (no embedding)
    seq, layers, hidden = 4096, LLAMA3_8B["num_hidden_layers"], LLAMA3_8B["hidden_size"]
    # Frozen base: forward (2N) + backward through activations only (2N) = 4N per token, plus causal
    # attention's score and value products (forward 2 x 2 x seq/2 x hidden per layer, backward twice that).
    flops_per_token = 4 * params + 3 * 2 * 2 * layers * hidden * seq / 2
    name = torch.cuda.get_device_properties(0).name
    peak = next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)
    tps = row["median_step_tokens_per_s"]
    row.update(
        {
            "model_created_s": round(made_s, 1),
            "flops_per_token": flops_per_token,
            "mfu": round(tps * flops_per_token / peak, 3) if peak else None,
            "anchor_tokens_per_s": NEMO_ANCHOR_TOKENS_PER_S,
            "vs_anchor": round(tps / NEMO_ANCHOR_TOKENS_PER_S, 3),
        }
    )
    rec.add("throughput", row)


def phase_serve(rec: Recorder, model: Path, root: Path) -> None:
    import httpx
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bench.serve_load import PROMPTS, load, one_request
    from ladle.platform.processes import stop_process
    from tests.helpers import start_server

    tokenizer = AutoTokenizer.from_pretrained(model)
    # The server's own choice (ladle/serve/backends.py): bf16 on a GPU, float32 on a CPU.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    offline_model = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(device).eval()
    offline = []
    for prompt in PROMPTS:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"].to(device)
        out = offline_model.generate(ids, max_new_tokens=32, do_sample=False)
        offline.append(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    del offline_model

    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False).input_ids)

    for max_batch in (32, 1):
        proc, url = start_server(model, root / f"serve-{max_batch}.log", max_batch_size=max_batch)
        try:
            with httpx.Client(timeout=120) as http:
                served = [one_request(http, url, "tiny", p)[2] for p in PROMPTS]
            row = {
                "server": f"ladle transformers backend, max_batch={max_batch}",
                "greedy_equals_offline": served == offline,
                "served": served,
                "offline": offline,
                "levels": [load(url, "tiny", clients, 4.0, count) for clients in (1, 8, 32)],
            }
            rec.add("serve", row)
        finally:
            stop_process(proc, grace_s=10, group=True)


def summary(paths: list[Path]) -> None:
    """One line per recorded row: what ran, whether it learned, predicted vs measured peak, tokens/s."""
    for path in paths:
        if not path.exists():
            print(f"{path}: missing")
            continue
        data = json.loads(path.read_text())
        print(f"{path}: {data.get('device')} {data.get('versions')}")
        for phase, rows in data["phases"].items():
            for r in rows:
                if "failed" in r:
                    print(f"  {phase:10} {r.get('label', r.get('server', ''))}: FAILED {r['failed'][-600:]}")
                elif phase == "serve":
                    levels = ", ".join(f"{x['clients']}:{x['tokens_per_s']} tok/s e{x['errors']}" for x in r["levels"])
                    print(f"  serve      {r['server']}: greedy==offline {r['greedy_equals_offline']}; {levels}")
                else:
                    print(
                        f"  {phase:10} {r['label']:20} {r['strategy']:6} ws={r['world_size']} {r['dtype']} "
                        f"loss {r['loss_first']:.3f}->{r['loss_last']:.3f} eval {r['eval_before']:.3f}->"
                        f"{r['eval_after']:.3f} peak {r['measured_peak_mib']:.0f} MiB pred {r['predicted_peak_mib']:.0f}"
                        f" ({r['predicted_over_measured']}) load {r['measured_load_mib']:.0f}/{r['predicted_load_mib']:.0f}"
                        f" tok/s {r['median_step_tokens_per_s']:.0f} wall {r['wall_s']}s"
                        + (f" MFU {r['mfu']} vs anchor {r['vs_anchor']}" if "mfu" in r else "")
                        + f" | {json.dumps(r['sharding'])[:300]}"
                    )


def main() -> None:
    if sys.argv[1:2] == ["--summary"]:
        summary([Path(p) for p in sys.argv[2:]])
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("--phases", default="strategies,throughput,serve")
    parser.add_argument("--only", default="", help="strategy rows by label, comma-separated")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps of the throughput run")
    parser.add_argument("--serve-model", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench/gpu_truth.py needs a CUDA GPU; torch sees none on this host.")
    args.out.mkdir(parents=True, exist_ok=True)
    rec = Recorder(args.out / "gpu_truth.json", header())
    print(json.dumps({k: v for k, v in rec.data.items() if k != "phases"}), flush=True)
    phases = args.phases.split(",")
    with tempfile.TemporaryDirectory(prefix="ladle-gpu-truth-") as tmp:
        root = Path(tmp)
        for phase in phases:
            began = time.perf_counter()
            try:
                if phase == "strategies":
                    phase_strategies(rec, root, set(filter(None, args.only.split(","))) or None)
                elif phase == "throughput":
                    phase_throughput(rec, root, args.steps)
                elif phase == "serve":
                    if args.serve_model is None:
                        raise SystemExit("--serve-model DIR: a merged model folder to serve")
                    phase_serve(rec, args.serve_model, root)
                else:
                    raise SystemExit(f"unknown phase {phase!r}: strategies, throughput or serve")
            except Exception as exc:  # noqa: BLE001 - a phase's failure is recorded; the next phase still runs
                rec.add(phase, {"failed": f"{type(exc).__name__}: {exc}"[-3000:], "trace": traceback.format_exc()})
            print(f"phase {phase}: {time.perf_counter() - began:.0f} s", flush=True)
    subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,clocks.max.sm", "--format=csv"], check=False)


if __name__ == "__main__":
    main()
