"""TRL's side of bench/gpu_train.py: SFTTrainer on a pre-tokenized dataset at its best honest settings.

    python bench/trl_gpu_worker.py MODEL_DIR DATA.jsonl OUT_DIR STEPS SEQ_LEN LORA_R [--cpu]

Same work as ladle's row: LoRA of rank LORA_R on every linear layer (alpha 2r, no dropout, nothing else trained),
bf16 weights, packed rows of SEQ_LEN tokens (best-fit decreasing, padding-free: position ids restart per example,
no pad tokens), micro-batch 1, no gradient accumulation, no activation checkpointing (SFTConfig's default is on;
ladle's 8B row runs without), Liger's kernels on (``use_liger_kernel``: its fused linear cross-entropy, RMSNorm,
SwiGLU, RoPE). Prints one ``TRL_RESULT {json}`` line: every step's seconds and tokens, and the median tokens/s of
the steps after the first two (the warm-up ladle's row leaves out too). ``--cpu``: float32, no Liger (a check of
the script on a machine without a GPU, not a measurement).
"""

from __future__ import annotations

import json
import statistics
import sys
import time


def step_clock():
    """A trainer callback keeping the seconds and input tokens of every optimizer step (``rows``), CUDA
    synchronised at both ends: the clock of TRL's SFT and DPO rows alike (``trl_gpu_dpo_worker.py``)."""
    import torch
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def __init__(self):
            self.rows, self.began, self.seen = [], 0.0, 0

        def on_step_begin(self, args, state, control, **kwargs):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.began, self.seen = time.perf_counter(), int(state.num_input_tokens_seen)

        def on_step_end(self, args, state, control, **kwargs):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            seconds = time.perf_counter() - self.began
            self.rows.append({"seconds": seconds, "tokens": int(state.num_input_tokens_seen) - self.seen})

    return StepClock()


def main() -> None:
    import torch
    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    model_dir, data_file, out, steps, seq_len, rank = sys.argv[1:7]
    cpu = "--cpu" in sys.argv[7:]
    dtype = torch.float32 if cpu else torch.bfloat16
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    began = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
    loaded_s = time.perf_counter() - began
    args = SFTConfig(
        output_dir=out,
        max_steps=int(steps),
        per_device_train_batch_size=1,
        gradient_accumulation_steps=1,
        learning_rate=2e-4,
        lr_scheduler_type="cosine",
        max_length=int(seq_len),
        packing=True,
        packing_strategy="bfd",
        padding_free=True,
        bf16=not cpu,
        use_cpu=cpu,
        gradient_checkpointing=False,
        use_liger_kernel=not cpu,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        dataloader_num_workers=0,
        seed=0,
        include_num_input_tokens_seen="non_padding",
    )
    r = int(rank)
    lora = LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    dataset = load_dataset("json", data_files=data_file, split="train")
    clock = step_clock()
    trainer = SFTTrainer(
        model=model, args=args, train_dataset=dataset, processing_class=tokenizer, peft_config=lora, callbacks=[clock]
    )
    trainer.train()
    report(
        trainer,
        clock,
        load_s=round(loaded_s, 1),
        liger=bool(args.use_liger_kernel),
        padding_free=bool(args.padding_free),
    )


def report(trainer, clock, **extra) -> None:
    """The ``TRL_RESULT`` line both TRL rows print: median steady tokens/s (the first two steps left out), each
    step's clock, the losses and the peak memory, with what the row adds."""
    import torch

    steady = [row["tokens"] / row["seconds"] for row in clock.rows[2:]] or [0.0]
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    peak = torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else 0.0
    result = {"median_step_tokens_per_s": round(statistics.median(steady), 1), "steps": clock.rows, "losses": losses}
    print("TRL_RESULT " + json.dumps({**result, "peak_mib": round(peak, 1), **extra}), flush=True)


if __name__ == "__main__":
    main()
