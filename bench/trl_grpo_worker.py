"""One rank of the TRL side of bench/grpo_vs_trl.py (started by `accelerate launch`): TRL's GRPOTrainer with its own
generation (``model.generate``; no vLLM on a CPU), the same prompts, rewards, group, lengths and LoRA as ladle."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import sys
import time

import trl.trainer.grpo_trainer as grpo_module
from datasets import load_dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer
from trl_sft_worker import StepClock  # the same clock of seconds inside optimizer steps

from ladle.recipes.rewards.colours import items_in_place

GENERATION = [0.0]
_profiling = grpo_module.profiling_context


@contextlib.contextmanager
def timed(trainer, name):
    """TRL's own profiling spans, with the generation's seconds kept (the rest of a step is scoring and update)."""
    began = time.perf_counter()
    with _profiling(trainer, name):
        yield
    if "generate" in name:
        GENERATION[0] += time.perf_counter() - began


grpo_module.profiling_context = timed


def exact_match(prompts, completions, answer, **kwargs):
    """ladle's built-in exact_match, as a TRL reward."""
    return [float(c[0]["content"].strip() == a.strip()) for c, a in zip(completions, answer, strict=True)]


def main() -> None:
    model_dir, data_file, out, steps, per_device, group, length, lr, seed = sys.argv[1:10]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    args = GRPOConfig(
        output_dir=out,
        max_steps=int(steps),
        per_device_train_batch_size=int(per_device),
        gradient_accumulation_steps=1,
        num_generations=int(group),
        max_completion_length=int(length),
        temperature=1.0,
        learning_rate=float(lr),
        lr_scheduler_type="constant",
        beta=0.0,
        loss_type="dapo",
        use_cpu=True,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        dataloader_num_workers=0,
        seed=int(seed),
        ddp_find_unused_parameters=False,
        bf16=False,  # the same precision as ladle's plan here (float32)
        gradient_checkpointing=False,
    )
    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    dataset = load_dataset("json", data_files=data_file, split="train")
    clock = StepClock()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[items_in_place, exact_match],
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=lora,
        callbacks=[clock],
    )
    trainer.train()
    history = [h for h in trainer.state.log_history if "reward" in h]
    lengths = [h["completions/mean_length"] for h in history]
    # One write of the whole line: both ranks print to one pipe, and print() writes the line and its newline
    # apart, so the other rank's line could fall between them.
    line = "TRL_RESULT " + json.dumps(
        {
            "rank": trainer.accelerator.process_index,
            "seconds": clock.seconds,
            "generation_s": GENERATION[0],
            "rewards": [h["reward"] for h in history],
            "mean_lengths": lengths,
            "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        }
    )
    sys.stdout.flush()
    os.write(1, (line + "\n").encode())


if __name__ == "__main__":
    main()
