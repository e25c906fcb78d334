"""One rank of the TRL side of bench/dpo_vs_trl.py (started by `accelerate launch`)."""

from __future__ import annotations

import json
import os
import resource
import sys
import time

from datasets import load_dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import DPOConfig, DPOTrainer
from trl_sft_worker import StepClock  # the same clock of seconds inside optimizer steps


def main() -> None:
    model_dir, data_file, out, steps, micro, seq_len, lr, precompute, ends = sys.argv[1:10]
    began = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    args = DPOConfig(
        output_dir=out,
        max_steps=int(steps),
        per_device_train_batch_size=int(micro),
        gradient_accumulation_steps=1,
        learning_rate=float(lr),
        lr_scheduler_type="cosine",
        warmup_steps=3,
        max_length=int(seq_len),
        beta=0.1,
        loss_type=["sigmoid"],
        precompute_ref_log_probs=precompute == "true",
        use_cpu=True,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        dataloader_num_workers=0,
        seed=0,
        ddp_find_unused_parameters=False,
        # DPOConfig defaults to bf16 and gradient checkpointing on accelerators; run what ladle's plan runs here.
        bf16=False,
        gradient_checkpointing=False,
    )
    lora = LoraConfig(
        r=16,
        lora_alpha=32,
        target_modules="all-linear",
        modules_to_save=None if ends == "none" else ends.split(","),
        task_type="CAUSAL_LM",
    )
    dataset = load_dataset("json", data_files=data_file, split="train")
    clock = StepClock()
    trainer = DPOTrainer(
        model=model, args=args, train_dataset=dataset, processing_class=tokenizer, peft_config=lora, callbacks=[clock]
    )
    trainer.train()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    # One write of the whole line: both ranks print to one pipe, and print() writes the line and its newline
    # apart, so the other rank's line could fall between them.
    line = "TRL_RESULT " + json.dumps(
        {
            "rank": trainer.accelerator.process_index,
            "tokens": int(trainer._total_train_tokens),
            "seconds": clock.seconds,
            "tokens_per_s": trainer._total_train_tokens / clock.seconds,
            "losses": losses,
            "train_loss": losses[-1] if losses else None,
            "peak_mib": peak,
            "wall_s": time.perf_counter() - began,
        }
    )
    sys.stdout.flush()
    os.write(1, (line + "\n").encode())


if __name__ == "__main__":
    main()
