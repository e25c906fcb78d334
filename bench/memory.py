"""Per-rank memory of ddp, zero3 and fsdp2 on 2 gloo processes: measured against the planner's prediction.

The model is a locally created random-init Llama whose float32 weights (1.5 GB) dominate each process, so
sharding shows in resident memory. For each strategy, a LoRA run and a full fine-tune of 2 steps record,
per rank (the largest rank):

- baseline: peak RSS before any weight is loaded (interpreter, torch, transformers, DeepSpeed, gloo);
- load: peak RSS once the model is loaded and wrapped, before the first step;
- peak: peak RSS of the whole run.

and the planner's per-rank prediction for this CPU host (no CUDA context, float32) for the load and the
step, compared with the measured peak minus the baseline. Then the merge of a LoRA adapter into the same
base: peak RSS of the streaming merge against one full copy of the weights.

    python bench/memory.py [--only ddp,fsdp2] [--modes lora,full] [--shape deep|wide-vocab|large] [--set k=v]

Runs one training at a time (memory, not speed, is measured; two at once would not change a process's
RSS, but the full fine-tunes need ~15 GB together).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import random_llama, save  # noqa: E402

MIB = 2**20
SHAPE = {
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "vocab_size": 32000,
}
# Llama-3's 128k vocabulary on 4 layers: the embedding and the head (501 MiB each in float32) are 84 % of the
# weights, so what happens to the head (gathered, or kept sharded) shows in each rank's peak.
WIDE_VOCAB = {**SHAPE, "num_hidden_layers": 4, "vocab_size": 128256}
# The size the memory-truth issue measured with (0.73B parameters, 2.8 GB in float32): LoRA rows only, as there
# (a full fine-tune's DDP replica with its Adam states would need ~24 GB for the two ranks).
LARGE = {
    **SHAPE,
    "hidden_size": 1536,
    "intermediate_size": 4096,
    "num_hidden_layers": 25,
    "num_attention_heads": 24,
    "num_key_value_heads": 8,
}
SHAPES = {
    "deep": ("big-random-llama-v1", SHAPE),
    "wide-vocab": ("wide-vocab-random-llama-v1", WIDE_VOCAB),
    "large": ("large-random-llama-v1", LARGE),
}


def big_model(shape: str = "deep") -> Path:
    """A random Llama of ``SHAPES`` (created once, in 400 MB shards, under $LADLE_HOME/assets)."""
    return random_llama(*SHAPES[shape])


def config_for(base: Path, strategy: str, lora: bool, overrides: list[str]):
    from ladle.config import build_config

    return build_config(
        {
            "base": str(base),
            "data": {"path": "ladle://demo-alpaca", "seq_len": 128},
            "parallelism": {"strategy": strategy},
            "training": {
                "max_steps": 2,
                "micro_batch_size": 1,
                "global_batch_size": 2,
                "eval_every": 0,
                "checkpoint_every": 0,
                "lora": {"enabled": lora, "target_modules": "all-linear", "modules_to_save": []},
            },
        },
        overrides,
    )


def predicted(cfg, plan, model_config: dict) -> dict:
    """The planner's per-rank figures for this plan on this host, in MiB."""
    from ladle.plan.planner import plan_estimate

    est = plan_estimate(cfg, plan, model_config)
    # The load as `ladle plan` reports it: what loading holds plus the CPU runtime and DeepSpeed's engine.
    load = est.load + est.context
    return {"load": load / MIB, "step": est.total / MIB, "peak": est.peak / MIB, "breakdown": est.summary()}


def run(base: Path, strategy: str, lora: bool, root: Path, overrides: list[str]) -> dict:
    from ladle.data.prepare import prepare
    from ladle.machine.topology import probe
    from ladle.plan.planner import make_plan
    from ladle.train.run import launch
    from ladle.train.spec import TrainSpec

    cfg = config_for(base, strategy, lora, overrides)
    model_config = json.loads((base / "config.json").read_text())
    plan = make_plan(cfg, probe(env={}, query_output=""), model=model_config)
    dataset = prepare(cfg.data, base, str(root))
    name = f"{strategy}-{'lora' if lora else 'full'}"
    spec = TrainSpec(config=cfg, plan=plan, dataset=dataset, base_dir=str(base), run_url=str(root / name))
    result = launch(spec)
    guess = predicted(cfg, plan, model_config)
    row = {
        "strategy": strategy,
        "mode": "lora" if lora else "full",
        "baseline_mib": result.baseline_memory_mib,
        "load_mib": result.load_peak_memory_mib,
        "peak_mib": result.peak_memory_mib,
        "measured_above_baseline_mib": result.peak_memory_mib - result.baseline_memory_mib,
        "load_above_baseline_mib": result.load_peak_memory_mib - result.baseline_memory_mib,
        "predicted_load_mib": guess["load"],
        "predicted_step_mib": guess["step"],
        "predicted_peak_mib": guess["peak"],
        "breakdown": guess["breakdown"],
        "parameter_share": result.sharding.get("parameter_share"),
        "tokens_per_s": result.tokens_per_s,
        "losses": result.train_losses,
        "adapter_url": result.adapter_url,
    }
    row["prediction_ratio"] = row["predicted_peak_mib"] / row["measured_above_baseline_mib"]
    row["load_prediction_ratio"] = row["predicted_load_mib"] / row["load_above_baseline_mib"]
    print(json.dumps({k: v for k, v in row.items() if k != "losses"}), flush=True)
    return row


MERGE_SCRIPT = """
import json, resource, sys, time
from pathlib import Path
from ladle.lifecycle.merge import merge_adapter
t = time.perf_counter()
merge_adapter(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), "float32")
print(json.dumps({"peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "seconds": time.perf_counter() - t}))
"""

WHOLE_MERGE_SCRIPT = """
import json, resource, sys, time
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM
t = time.perf_counter()
base = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
merged = PeftModel.from_pretrained(base, sys.argv[2]).merge_and_unload()
merged.save_pretrained(sys.argv[3], safe_serialization=True)
print(json.dumps({"peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "seconds": time.perf_counter() - t}))
"""


def merge_peaks(base: Path, adapter: Path, root: Path) -> dict:
    """Peak RSS of the streaming merge and of peft's whole-model merge_and_unload, each in a fresh process."""
    out = {}
    for name, script in (("streaming", MERGE_SCRIPT), ("whole_model", WHOLE_MERGE_SCRIPT)):
        done = subprocess.run(
            [sys.executable, "-c", script, str(base), str(adapter), str(root / f"merged-{name}")],
            capture_output=True,
            text=True,
            check=True,
        )
        out[name] = json.loads(done.stdout.strip().splitlines()[-1])
    weights = sum(f.stat().st_size for f in base.glob("*.safetensors")) / MIB
    out["weights_mib"] = weights
    out["largest_shard_mib"] = max(f.stat().st_size for f in base.glob("*.safetensors")) / MIB
    print(json.dumps(out), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default="ddp,zero3,fsdp2")
    parser.add_argument("--modes", default="lora,full")
    parser.add_argument("--set", action="append", default=[], help="config overrides, as ladle's --set")
    parser.add_argument("--no-merge", action="store_true")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="deep")
    args = parser.parse_args()
    from ladle.platform import storage

    base = big_model(args.shape)
    rows = []
    with tempfile.TemporaryDirectory(prefix="ladle-bench-memory-") as tmp:
        root = Path(tmp)
        for mode in args.modes.split(","):
            for strategy in args.only.split(","):
                rows.append(run(base, strategy, mode == "lora", root, args.set))
        merge = None
        adapter_url = next((r["adapter_url"] for r in rows if r["adapter_url"]), None)
        if adapter_url and not args.no_merge:
            adapter = storage.download_dir(adapter_url, root / "adapter")
            merge = merge_peaks(base, adapter, root)
    for mode in ("lora", "full"):
        ddp = next((r for r in rows if r["strategy"] == "ddp" and r["mode"] == mode), None)
        for r in rows:
            if ddp and r["mode"] == mode:
                r["peak_vs_ddp"] = r["peak_mib"] / ddp["peak_mib"]
    save("memory", {"rows": rows, "merge": merge, "shape": SHAPES[args.shape][1], "self_peak_mib": self_peak()})


def self_peak() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


if __name__ == "__main__":
    main()
