"""One rank of the TRL side of bench/train_vs_trl.py (started by `accelerate launch`)."""

from __future__ import annotations

import json
import sys
import time

from datasets import load_dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import SFTConfig, SFTTrainer


class StepClock(TrainerCallback):
    """Seconds spent inside optimizer steps (what ladle's worker times too)."""

    def __init__(self):
        self.seconds, self.began = 0.0, None

    def on_step_begin(self, args, state, control, **kwargs):
        self.began = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.seconds += time.perf_counter() - self.began


def main() -> None:
    model_dir, data_file, out, steps, micro, seq_len, lr, packing, dtype, checkpointing = sys.argv[1:11]
    # The tiny random-init model trains its ends; a pretrained one keeps them (an argument "none").
    ends = sys.argv[11] if len(sys.argv) > 11 else "lm_head,embed_tokens"
    modules_to_save = None if ends == "none" else ends.split(",")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    args = SFTConfig(
        output_dir=out,
        max_steps=int(steps),
        per_device_train_batch_size=int(micro),
        gradient_accumulation_steps=1,
        learning_rate=float(lr),
        lr_scheduler_type="cosine",
        warmup_steps=5,
        max_length=int(seq_len),
        packing=True,
        packing_strategy=packing,
        completion_only_loss=True,
        use_cpu=True,
        report_to=[],
        logging_steps=10**6,
        save_strategy="no",
        dataloader_num_workers=0,
        seed=0,
        include_num_input_tokens_seen="non_padding",
        ddp_find_unused_parameters=False,
        # SFTConfig defaults to bf16=True and gradient_checkpointing=True; bf16 would override the launcher's
        # --mixed_precision no. Run exactly the precision and checkpointing ladle's plan runs.
        bf16=dtype == "bfloat16",
        fp16=dtype == "float16",
        gradient_checkpointing=checkpointing == "true",
    )
    lora = LoraConfig(
        r=16,
        lora_alpha=32,
        target_modules="all-linear",
        modules_to_save=modules_to_save,
        task_type="CAUSAL_LM",
    )
    dataset = load_dataset("json", data_files=data_file, split="train")
    clock = StepClock()
    trainer = SFTTrainer(
        model=model, args=args, train_dataset=dataset, processing_class=tokenizer, peft_config=lora, callbacks=[clock]
    )
    trainer.train()
    if trainer.accelerator.is_main_process:
        tokens = int(trainer.state.num_input_tokens_seen)
        print(
            "TRL_RESULT "
            + json.dumps(
                {
                    "tokens": tokens,
                    "seconds": clock.seconds,
                    "tokens_per_s": tokens / clock.seconds,
                    "train_loss": trainer.state.log_history[-1].get("train_loss"),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
