"""One rank of the TRL side of bench/agent_vs_trl.py (started by `accelerate launch`): TRL's GRPOTrainer with
``environment_factory`` (its multi-turn tool loop over its own generation: ``model.generate``, no vLLM on a CPU),
the same model, template, questions, tool, reward, group, lengths and LoRA as ladle."""

from __future__ import annotations

import json
import os
import resource
import sys

from datasets import load_dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer
from trl.chat_template_utils import qwen3_template
from trl_sft_worker import StepClock  # the same clock of seconds inside optimizer steps

from ladle.agents.builtin import Calculator
from ladle.recipes.rewards.calculator import right_answer


class CalculatorEnvironment(Calculator):
    """The built-in calculator as TRL's environment_factory wants it: the same tool, and a reset."""

    def reset(self, **kwargs):
        return None


def main() -> None:
    model_dir, data_file, out, steps, per_device, group, budget, turns, lr, seed = sys.argv[1:11]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # The template writes Hermes calls as Qwen's does (<tool_call>\n{json}\n</tool_call>): TRL parses them with its
    # Qwen 3 response template (it recognises templates by their text, and this one is ladle's).
    tokenizer.response_template = qwen3_template
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    args = GRPOConfig(
        output_dir=out,
        max_steps=int(steps),
        per_device_train_batch_size=int(per_device),
        gradient_accumulation_steps=1,
        num_generations=int(group),
        max_completion_length=int(budget),
        max_tool_calling_iterations=int(turns) - 1,
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
        bf16=False,
        gradient_checkpointing=False,
    )
    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    dataset = load_dataset("json", data_files=data_file, split="train")
    clock = StepClock()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[right_answer],
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=lora,
        environment_factory=CalculatorEnvironment,
        callbacks=[clock],
    )
    trainer.train()
    history = [h for h in trainer.state.log_history if "reward" in h]
    line = "TRL_RESULT " + json.dumps(
        {
            "rank": trainer.accelerator.process_index,
            "seconds": clock.seconds,
            "rewards": [h["reward"] for h in history],
            "mean_lengths": [h["completions/mean_length"] for h in history],
            "tool_calls": [h.get("tools/call_frequency") for h in history],
            "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        }
    )
    sys.stdout.flush()
    os.write(1, (line + "\n").encode())


if __name__ == "__main__":
    main()
