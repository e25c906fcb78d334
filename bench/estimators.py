"""ladle's model-state memory vs DeepSpeed's own estimators, over real model sizes and GPU counts.

    .venv/bin/python bench/estimators.py

Per-GPU device bytes (and per-node host bytes with offload) for ZeRO-2 and ZeRO-3,
from `ladle.sizing.memory` and from DeepSpeed's `estimate_zero2_model_states_mem_needs` /
`estimate_zero3_model_states_mem_needs`, for the shipped model configs. The ratio
column is ladle / DeepSpeed (1.00 = identical). Parameter counts come from
`ladle.sizing.params` (equal to meta-device instantiation, tested).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import save  # noqa: E402

from ladle.sizing import memory  # noqa: E402
from ladle.sizing.params import count_params, read_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("llama-3.2-1b", "llama-3.1-8b", "qwen3-32b", "llama-3.1-70b")
LAYOUTS = ((1, 1), (8, 1), (8, 4))


def main() -> None:
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    rows = []
    for name in MODELS:
        config = read_config(ROOT / "recipes" / "models" / name)
        params, _ = count_params(config)
        largest = config["vocab_size"] * config["hidden_size"]
        for gpus, nodes in LAYOUTS:
            for offload in (False, True):
                _, ds2 = estimate_zero2_model_states_mem_needs(params, gpus, nodes, cpu_offload=offload)
                ours2 = memory.zero2(params, gpus, nodes, offload_optimizer=offload).device
                _, ds3, _ = estimate_zero3_model_states_mem_needs(
                    params, largest, gpus, nodes, cpu_offload=offload, cpu_offload_params=False
                )
                ours3 = memory.zero3(params, largest, gpus, nodes, offload_optimizer=offload).device
                rows.append(
                    {
                        "model": name,
                        "params": params,
                        "gpus": gpus,
                        "nodes": nodes,
                        "offload": offload,
                        "zero2_ladle_gib": ours2 / 2**30,
                        "zero2_deepspeed_gib": ds2 / 2**30,
                        "zero3_ladle_gib": ours3 / 2**30,
                        "zero3_deepspeed_gib": ds3 / 2**30,
                    }
                )
    print(
        f"{'model':<15}{'GPUs':>8}{'offload':>8}{'ZeRO-2 ladle':>14}{'DeepSpeed':>11}{'ratio':>7}"
        f"{'ZeRO-3 ladle':>14}{'DeepSpeed':>11}{'ratio':>7}"
    )
    for r in rows:
        print(
            f"{r['model']:<15}{r['gpus']:>4}x{r['nodes']:<3}{str(r['offload']):>8}"
            f"{r['zero2_ladle_gib']:>12.2f}G{r['zero2_deepspeed_gib']:>10.2f}G{r['zero2_ladle_gib'] / r['zero2_deepspeed_gib']:>7.3f}"
            f"{r['zero3_ladle_gib']:>12.2f}G{r['zero3_deepspeed_gib']:>10.2f}G{r['zero3_ladle_gib'] / r['zero3_deepspeed_gib']:>7.3f}"
        )
    print("saved", save("estimators", {"rows": rows}))


if __name__ == "__main__":
    main()
