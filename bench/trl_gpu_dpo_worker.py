"""TRL's side of bench/gpu_train.py's DPO rows: DPOTrainer at its best honest settings on the same pairs.

    python bench/trl_gpu_dpo_worker.py MODEL_DIR PAIRS-CHAT.jsonl OUT_DIR STEPS MICRO MAX_LENGTH [--cpu]

The same work as ladle's row: LoRA r 16 on every linear layer (alpha 32, no dropout), bf16, ``MICRO`` pairs per
step, no gradient accumulation, no activation checkpointing, the reference log-probabilities precomputed before
training (``precompute_ref_log_probs``: ladle's plan precomputes them too), padding-free batches, Liger's DPO
loss (``use_liger_kernel``; if TRL refuses it with adapters the row runs without and says so). The pairs are
conversational (prompt, chosen and rejected turns), so the model's chat template renders them as ladle's do.
Prints one ``TRL_RESULT {json}`` line: every step's seconds and input tokens, and the median tokens/s after the
first two steps. ``--cpu``: float32, no Liger (a check of the script, not a measurement).
"""

from __future__ import annotations

import sys
import time


def main() -> None:
    import torch
    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer
    from trl_gpu_worker import report, step_clock  # the SFT row's clock and result line: measured alike

    model_dir, data_file, out, steps, micro, max_length = sys.argv[1:7]
    cpu = "--cpu" in sys.argv[7:]

    dtype = torch.float32 if cpu else torch.bfloat16
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    dataset = load_dataset("json", data_files=data_file, split="train")

    def trainer_with(liger: bool):
        args = DPOConfig(
            output_dir=out,
            max_steps=int(steps),
            per_device_train_batch_size=int(micro),
            gradient_accumulation_steps=1,
            learning_rate=5e-6,
            lr_scheduler_type="cosine",
            max_length=int(max_length),
            beta=0.1,
            loss_type=["sigmoid"],
            precompute_ref_log_probs=True,
            padding_free=True,
            use_liger_kernel=liger,
            bf16=not cpu,
            use_cpu=cpu,
            gradient_checkpointing=False,
            report_to=[],
            logging_steps=1,
            save_strategy="no",
            dataloader_num_workers=0,
            seed=0,
            include_num_input_tokens_seen="non_padding",
        )
        clock = step_clock()
        trainer = DPOTrainer(
            model=model,
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
            peft_config=lora,
            callbacks=[clock],
        )
        return trainer, clock

    refused = None
    try:
        trainer, clock = trainer_with(liger=not cpu)
    except Exception as exc:  # noqa: BLE001 - TRL's refusal of Liger with adapters is recorded, not hidden
        refused = f"{type(exc).__name__}: {exc}"[:500]
        trainer, clock = trainer_with(liger=False)
    began = time.perf_counter()
    trainer.train()
    report(
        trainer,
        clock,
        train_s=round(time.perf_counter() - began, 1),
        liger=refused is None and not cpu,
        liger_refused=refused,
        padding_free=True,
        precompute_ref_log_probs=True,
    )


if __name__ == "__main__":
    main()
