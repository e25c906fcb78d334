"""Training throughput on one GPU, ladle beside TRL in the same run (bench/gpu_train.sh runs it).

    python bench/gpu_train.py [--phases ladle8b,trl8b,strategies,ladle8b-plain] [--out DIR] [--steps 8]
    python bench/gpu_train.py --tiny ...        # the same phases on the CPU with a tiny Llama: a check of the
                                                # script before a GPU is lent, not a measurement

Phases, each written to ``OUT/gpu_train.json`` as soon as it ends (a run cut short keeps what it measured):

- ``ladle8b``: Llama-3-8B shape (random init, bf16), LoRA r 16 on every linear layer, seq 4096 packed from
  1024-token examples, micro-batch 1, through ladle's ``launch`` with its default fast paths
  (``training.kernels``: per-block compile, Liger's fused linear cross-entropy, LoRA in bf16); the median
  step's tokens/s after two warm-up steps, MFU, and the memory model beside the measured peak.
- ``trl8b``: TRL's SFTTrainer on the same weights, data, LoRA, sequence length and packing, with Liger on and
  padding-free packing (``bench/trl_gpu_worker.py``), alone on the GPU.
- ``strategies``: 0.73B random Llama, seq 512, micro-batch 2, through ddp and fsdp2 with the default fast paths,
  supervised and DPO (``ladle://demo-preference``): losses, peak against the memory model, tokens/s (compare
  with bench/RESULTS.md's H200 table).
- ``ladle8b-plain``: the ``ladle8b`` row with every fast path off (``training.kernels``): what they add.
- ``dpo8b``: DPO on the 8B shape, LoRA r 16 on every linear layer, 2 pairs per step, each side a 256-token prompt and
  a 640-token answer (``data.seq_len`` 1024 a side), the reference precomputed; ``trldpo8b``: TRL's DPOTrainer on
  the same pairs (``bench/trl_gpu_dpo_worker.py``: precomputed reference, padding-free, Liger). Both count the
  input tokens of both sides (the prompt twice, as both forwards read it).

MFU: FLOPs per token = 4 x the matmul weights (the frozen base needs no weight gradients) + causal attention,
over the card's dense bf16 peak (989 TFLOP/s for H100 SXM and H200). NeMo's convention for LoRA, (2 + r)/3 of a
full step's 6 x N with r = trained share, is printed beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.gpu_truth import NEMO_ANCHOR_TOKENS_PER_S, PEAK_BF16_FLOPS, Recorder, train_row  # noqa: E402

TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}
PLAIN_KERNELS = [
    "training.kernels.fused_loss=off",
    "training.kernels.compile=false",
    "training.kernels.liger=false",
    "training.kernels.lora_compute=float32",
]


def header(tiny: bool) -> dict:
    if tiny:
        return {"device": "cpu (--tiny check)", "date": time.strftime("%Y-%m-%d")}
    from bench.gpu_truth import header as gpu_header

    return gpu_header()


def write_model(root: Path, tiny: bool) -> Path:
    """The 8B shape on the GPU (bf16, 5 GB shards); with ``tiny``, a small Llama with the demo tokenizer."""
    if not tiny:
        from bench.gpu_truth import write_8b

        return write_8b(root / "llama3-8b-random")
    from ladle.assets import tiny_model_dir
    from ladle.assets.demo import write_random_llama

    path = root / "tiny-llama"
    if not (path / "config.json").exists():
        write_random_llama(path, tiny_model_dir(), **TINY)
    return path


def write_tokens(root: Path, base: Path, rows: int) -> Path:
    """``rows`` packed rows' worth of 1024-token random examples (four fill a 4096-token row exactly)."""
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(base))
    rng = random.Random(0)
    data = root / "tokens.jsonl"
    with data.open("w") as f:
        for _ in range(4 * rows):
            f.write(json.dumps({"input_ids": [rng.randrange(3, vocab) for _ in range(1024)]}) + "\n")
    return data


def flops_per_token(shape: dict, seq: int, rank: int = 16) -> tuple[float, float]:
    """(ladle's convention: 4N + causal attention, NeMo's LoRA convention: (2 + r)/3 x 6N + attention, r the
    trained share: LoRA of ``rank`` on every linear layer of the blocks)."""
    h, kv = shape["hidden_size"], shape["num_key_value_heads"] * shape["head_dim"]
    layers, inter, vocab = shape["num_hidden_layers"], shape["intermediate_size"], shape.get("vocab_size", 0)
    n = layers * (2 * h * h + 2 * h * kv + 3 * h * inter) + h * vocab
    # q, o: h -> h; k, v: h -> kv; gate, up: h -> inter; down: inter -> h
    adapters = layers * rank * (2 * 2 * h + 2 * (h + kv) + 3 * (h + inter))
    attention = 3 * 2 * 2 * layers * h * seq / 2
    return 4 * n + attention, 6 * n * (2 + adapters / n) / 3 + attention


def ladle_8b(rec: Recorder, root: Path, base: Path, data: Path, steps: int, label: str, sets: list[str], tiny: bool):
    from ladle.config import build_config

    cfg = build_config(
        {
            "base": str(base),
            "data": {"path": str(data), "format": "tokenized", "seq_len": 4096, "eval_ratio": 0.05},
            "parallelism": {"strategy": "ddp", "gpus": 1} if not tiny else {"strategy": "ddp", "cpu_processes": 1},
            "training": {
                "max_steps": steps,
                "micro_batch_size": 1,
                "global_batch_size": 1,
                "dtype": "bfloat16" if not tiny else "auto",
                "eval_every": 0,
                "checkpoint_every": 0,
                "lora": {"enabled": True, "r": 16, "target_modules": "all-linear", "modules_to_save": []},
            },
        },
        sets,
    )
    row = train_row(label, base, root / label, cfg, steps_skip=2)
    shape = {**json.loads((base / "config.json").read_text())}
    ours, nemo = flops_per_token(shape, 4096)
    tps = row["median_step_tokens_per_s"]
    peak = peak_flops(tiny)
    row.update(
        {
            "flops_per_token": ours,
            "mfu": round(tps * ours / peak, 3) if peak else None,
            "mfu_nemo_convention": round(tps * nemo / peak, 3) if peak else None,
            "anchor_tokens_per_s": NEMO_ANCHOR_TOKENS_PER_S,
            "vs_anchor": round(tps / NEMO_ANCHOR_TOKENS_PER_S, 3),
        }
    )
    rec.add("throughput", row)
    return row


DPO_PROMPT, DPO_ANSWER, DPO_PAIRS = 256, 640, 64


def write_pairs(root: Path, base: Path) -> tuple[Path, Path]:
    """``DPO_PAIRS`` pairs of words from the model's tokenizer, as ladle reads them (prompt, chosen and rejected
    strings) and as TRL's conversational form (turns): the same text, rendered by the same chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base)
    words = [w for w in tokenizer.get_vocab() if w.isalpha()] or ["word"]
    rng = random.Random(0)

    def text(n: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n))

    plain, chat = root / "pairs.jsonl", root / "pairs-chat.jsonl"
    with plain.open("w") as p, chat.open("w") as c:
        for _ in range(DPO_PAIRS):
            q, a, b = text(DPO_PROMPT), text(DPO_ANSWER), text(DPO_ANSWER)
            p.write(json.dumps({"prompt": q, "chosen": a, "rejected": b}) + "\n")
            turns = {
                "prompt": [{"role": "user", "content": q}],
                "chosen": [{"role": "assistant", "content": a}],
                "rejected": [{"role": "assistant", "content": b}],
            }
            c.write(json.dumps(turns) + "\n")
    return plain, chat


def ladle_dpo_8b(rec: Recorder, root: Path, base: Path, pairs: Path, steps: int, tiny: bool) -> None:
    from ladle.config import build_config

    cfg = build_config(
        {
            "base": str(base),
            "data": {"path": str(pairs), "seq_len": 1024, "eval_ratio": 0.05},
            "parallelism": {"strategy": "ddp", "gpus": 1} if not tiny else {"strategy": "ddp", "cpu_processes": 1},
            "training": {
                "objective": "dpo",
                "max_steps": steps,
                "micro_batch_size": 2,
                "global_batch_size": 2,
                "lr": 5e-6,
                "dtype": "bfloat16" if not tiny else "auto",
                "eval_every": 0,
                "checkpoint_every": 0,
                "lora": {"enabled": True, "r": 16, "target_modules": "all-linear", "modules_to_save": []},
            },
        },
        [],
    )
    rec.add("dpo", train_row("ladle 8b dpo", base, root / "dpo", cfg, steps_skip=2))


def trl_dpo_8b(rec: Recorder, root: Path, base: Path, chat: Path, steps: int, tiny: bool, limit_s: float) -> None:
    worker = Path(__file__).resolve().parent / "trl_gpu_dpo_worker.py"
    argv = [sys.executable, str(worker), str(base), str(chat), str(root / "trl-dpo"), str(steps), "2", "1024"]
    run_trl_worker(rec, "trl 8b dpo (DPOTrainer, precomputed reference, padding-free)", argv, tiny, limit_s, "trl-dpo")


def run_trl_worker(rec: Recorder, label: str, argv: list[str], tiny: bool, limit_s: float, phase: str) -> dict | None:
    """Run one of TRL's workers and record its ``TRL_RESULT`` line (or why there is none)."""
    began = time.perf_counter()
    try:
        proc = subprocess.run(
            argv + (["--cpu"] if tiny else []), capture_output=True, text=True, timeout=limit_s, check=False
        )
    except subprocess.TimeoutExpired as exc:
        rec.add(phase, {"label": label, "failed": f"ran past {limit_s:.0f} s", "tail": str(exc.stdout)[-2000:]})
        return None
    found = re.search(r"^TRL_RESULT (.*)$", proc.stdout, re.M)
    if proc.returncode or not found:
        rec.add(
            phase, {"label": label, "failed": f"exit {proc.returncode}", "tail": (proc.stdout + proc.stderr)[-3000:]}
        )
        return None
    row = {"label": label, **json.loads(found.group(1)), "wall_s": round(time.perf_counter() - began, 1)}
    rec.add(phase, row)
    return row


def peak_flops(tiny: bool) -> float | None:
    if tiny:
        return None
    import torch

    name = torch.cuda.get_device_properties(0).name
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def trl_8b(rec: Recorder, root: Path, base: Path, data: Path, steps: int, tiny: bool, limit_s: float):
    worker = Path(__file__).resolve().parent / "trl_gpu_worker.py"
    argv = [sys.executable, str(worker), str(base), str(data), str(root / "trl"), str(steps), "4096", "16"]
    began = time.perf_counter()
    try:
        proc = subprocess.run(
            argv + (["--cpu"] if tiny else []), capture_output=True, text=True, timeout=limit_s, check=False
        )
    except subprocess.TimeoutExpired as exc:
        rec.add("trl", {"label": "trl 8b", "failed": f"ran past {limit_s:.0f} s", "tail": str(exc.stdout)[-2000:]})
        return
    found = re.search(r"^TRL_RESULT (.*)$", proc.stdout, re.M)
    if proc.returncode or not found:
        rec.add(
            "trl", {"label": "trl 8b", "failed": f"exit {proc.returncode}", "tail": (proc.stdout + proc.stderr)[-3000:]}
        )
        return
    row = {"label": "trl 8b (SFTTrainer, Liger, padding-free)", **json.loads(found.group(1))}
    row["wall_s"] = round(time.perf_counter() - began, 1)
    shape = json.loads((base / "config.json").read_text())
    ours, nemo = flops_per_token(shape, 4096)
    peak = peak_flops(tiny)
    tps = row["median_step_tokens_per_s"]
    row["mfu"] = round(tps * ours / peak, 3) if peak else None
    row["mfu_nemo_convention"] = round(tps * nemo / peak, 3) if peak else None
    rec.add("trl", row)


def strategies(rec: Recorder, root: Path, tiny: bool) -> None:
    from bench.common import random_llama
    from bench.memory import SHAPES, config_for

    base = write_model(root, True) if tiny else random_llama(*SHAPES["large"])
    # DPO rows: the preference objective's paired forward (chosen and rejected as one batch, the reference by
    # the adapters switched off), its chunked log-probabilities and its memory model, on the device.
    dpo = ["training.objective=dpo", "data.path=ladle://demo-preference", "training.preference.beta=0.1"]
    rows = [("ddp lora", "ddp", []), ("fsdp2 lora", "fsdp2", []), ("ddp dpo lora", "ddp", dpo)]
    rows.append(("fsdp2 dpo lora", "fsdp2", dpo))
    only = os.environ.get("ROWS")  # e.g. ROWS="ddp dpo lora,fsdp2 dpo lora": rerun the rows a call cut short
    rows = [r for r in rows if not only or r[0] in only.split(",")]
    for label, strategy, objective in rows:
        sets = [
            "training.dtype=bfloat16" if not tiny else "training.dtype=auto",
            "parallelism.gpus=1" if not tiny else "parallelism.cpu_processes=1",
            "data.seq_len=512",
            "training.micro_batch_size=2",
            "training.global_batch_size=4",
            "training.max_steps=6",
            *objective,
        ]
        try:
            cfg = config_for(base, strategy, True, sets)
            rec.add("strategies", train_row(label, base, root / "s", cfg, steps_skip=2))
        except Exception as exc:  # noqa: BLE001 - each row's failure is a result to record
            rec.add("strategies", {"label": label, "failed": f"{type(exc).__name__}: {exc}"[-3000:]})


def summary(path: Path) -> None:
    data = json.loads(path.read_text())
    print(f"{data.get('device')} {data.get('versions', '')}")
    for phase, rows in data["phases"].items():
        for r in rows:
            if "failed" in r:
                print(f"  {phase:10} {r.get('label')}: FAILED {r['failed'][-300:]} {r.get('tail', '')[-1500:]}")
                continue
            tps = r.get("median_step_tokens_per_s")
            mem = (
                f" peak {r['measured_peak_mib']:.0f} MiB pred {r['predicted_peak_mib']:.0f} ({r['predicted_over_measured']})"
                if "measured_peak_mib" in r
                else f" peak {r.get('peak_mib')} MiB"
            )
            losses = r.get("step_tokens_per_s") and f" loss {r['loss_first']:.3f}->{r['loss_last']:.3f}" or ""
            print(
                f"  {phase:10} {r['label']:42} tok/s {tps} MFU {r.get('mfu')} (NeMo conv. {r.get('mfu_nemo_convention')})"
                f"{mem}{losses} wall {r.get('wall_s')}s kernels {r.get('kernels', '')}"
            )


def main() -> None:
    if sys.argv[1:2] == ["--summary"]:
        summary(Path(sys.argv[2]))
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("--phases", default="ladle8b,trl8b,strategies,ladle8b-plain")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--trl-limit-s", type=float, default=240)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out" / "gpu-train")
    parser.add_argument("--work", type=Path, default=None, help="folder for the model and data (kept)")
    parser.add_argument("--tiny", action="store_true", help="the phases on the CPU with a tiny Llama (a check)")
    args = parser.parse_args()
    if not args.tiny:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("bench/gpu_train.py needs a CUDA GPU; torch sees none (--tiny checks it on the CPU).")
    args.out.mkdir(parents=True, exist_ok=True)
    rec = Recorder(args.out / f"gpu_train-{args.phases.replace(',', '-')}.json", header(args.tiny))
    with tempfile.TemporaryDirectory(prefix="ladle-gpu-train-") as tmp:
        root = args.work or Path(tmp)  # --work: kept, so phases run as separate processes share the model
        root.mkdir(parents=True, exist_ok=True)
        base = data = None
        for phase in args.phases.split(","):
            began = time.perf_counter()
            try:
                if phase in ("ladle8b", "trl8b", "ladle8b-plain", "dpo8b", "trldpo8b") and base is None:
                    base = write_model(root, args.tiny)
                    data = root / "tokens.jsonl"
                    if not data.exists():
                        data = write_tokens(root, base, args.steps + 4)
                    print(f"model and data written in {time.perf_counter() - began:.0f} s", flush=True)
                if phase == "ladle8b":
                    # EXTRA_SETS="training.kernels.packed_attention=true": the row with settings the defaults lack
                    extra = os.environ.get("EXTRA_SETS", "").split()
                    label = "ladle 8b (default kernels" + (f", {' '.join(extra)})" if extra else ")")
                    ladle_8b(rec, root, base, data, args.steps, label, extra, args.tiny)
                elif phase == "ladle8b-plain":
                    ladle_8b(rec, root, base, data, args.steps, "ladle 8b (kernels off)", PLAIN_KERNELS, args.tiny)
                elif phase == "trl8b":
                    trl_8b(rec, root, base, data, args.steps, args.tiny, args.trl_limit_s)
                elif phase == "strategies":
                    strategies(rec, root, args.tiny)
                elif phase in ("dpo8b", "trldpo8b"):
                    pairs, chat = root / "pairs.jsonl", root / "pairs-chat.jsonl"
                    if not chat.exists():
                        pairs, chat = write_pairs(root, base)
                    if phase == "dpo8b":
                        ladle_dpo_8b(rec, root, base, pairs, args.steps, args.tiny)
                    else:
                        trl_dpo_8b(rec, root, base, chat, args.steps, args.tiny, args.trl_limit_s)
                else:
                    raise SystemExit(f"unknown phase {phase!r}")
            except Exception as exc:  # noqa: BLE001 - recorded; the next phase still runs
                rec.add(
                    phase,
                    {"label": phase, "failed": f"{type(exc).__name__}: {exc}"[-3000:], "tail": traceback.format_exc()},
                )
            print(f"phase {phase}: {time.perf_counter() - began:.0f} s", flush=True)
    summary(rec.path)


if __name__ == "__main__":
    main()
