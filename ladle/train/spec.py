"""What the launcher hands the worker, and what the worker hands back."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from ladle.config import LadleConfig
from ladle.data.prepare import PreparedDataset
from ladle.plan.planner import Plan

PROGRESS_PREFIX = "LADLE_PROGRESS "


class TrainSpec(BaseModel):
    config: LadleConfig
    plan: Plan
    dataset: PreparedDataset
    base_dir: str = Field(description="Local folder of the base model and tokenizer.")
    run_url: str = Field(description="Artifact-store folder of this pipeline run.")
    tracking_uri: str | None = None
    mlflow_run_id: str | None = None
    parity_probe: list[dict] = Field(
        default_factory=list,
        description="Held-out conversations as training tokenized them (``ladle.lifecycle.parity.ProbeRow``): the "
        "training process records its model's log-probabilities of them at the end, which the server must match.",
    )
    reward_files: dict[str, str] = Field(
        default_factory=dict,
        description="grpo: the text of every reward named by a file, by its path as written (it travels with the run).",
    )


class TrainResult(BaseModel):
    strategy: str = Field(description="Strategy that actually ran.")
    world_size: int = Field(description="Processes the worker actually saw.")
    backend: str = Field(description="torch.distributed backend that actually ran.")
    steps: int
    resumed_from_step: int = 0
    train_losses: list[float]
    train_loss_first: float
    train_loss_last: float
    eval_loss_before: float = Field(
        description="Held-out loss before training; grpo: the negative held-out mean reward (0 without eval prompts)."
    )
    eval_loss_after: float = Field(description="The same after training.")
    real_tokens: int = Field(description="Non-padding tokens processed by this run's steps (all ranks).")
    tokens_per_s: float = Field(description="Real tokens per second over the training steps.")
    train_seconds: float
    adapter_url: str | None = Field(description="Saved LoRA adapter folder (null for full fine-tunes).")
    model_url: str | None = Field(description="Saved full model folder (full fine-tunes).")
    peak_memory_mib: float = Field(0.0, description="Largest per-rank peak: CUDA allocated on GPUs, RSS on CPU.")
    load_peak_memory_mib: float = Field(
        0.0, description="Largest per-rank peak once the model was loaded and wrapped, before the first step."
    )
    baseline_memory_mib: float = Field(
        0.0, description="Largest per-rank peak before any weight was loaded (the process and its libraries)."
    )
    weights_dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="The dtype the trained weights were held in (the merge writes this dtype)."
    )
    parity_dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None,
        description="The dtype the training process's parity forward computed in (parity_logps): float32 where "
        "autocast was set aside for it; null: weights_dtype.",
    )
    sharding: dict = Field(
        default_factory=dict, description="What the strategy verified in the worker (e.g. per-rank parameter share)."
    )
    preference: dict[str, float] | None = Field(
        None,
        description="Preference tuning: held-out rewards, margin and preference accuracy before and after "
        "(`eval_*_before`, `eval_*_after`); null for supervised fine-tuning.",
    )
    rl: dict[str, float | str | list[list[float]]] | None = Field(
        None,
        description="grpo: held-out mean reward before and after (`eval_reward_before`, `eval_reward_after`), the "
        "first and last steps' mean rewards, the largest rollout_logprob_gap, the probe's `[step, score]` checks "
        "during training (`probe_trend`) and what its guard did (`probe_guard`); null for other objectives.",
    )
    parity_probe: list[dict] = Field(
        default_factory=list, description="The probe rows those are of (the spec's, set by the launching task)."
    )
    tool_parity: list[dict] = Field(
        default_factory=list,
        description="An agent's held-out episodes' first turns as the training process rolled them out, greedy "
        "(``ladle.lifecycle.parity.ToolCase``): the served model's answer to each must parse to the same tool calls.",
    )
    parity_logps: list[list[float]] | None = Field(
        None,
        description="Each parity probe row's per-token log-probabilities by the trained model, in the training "
        "process (null: no probe rows, or the strategy splits one forward over ranks).",
    )
    kernels: dict[str, str] = Field(
        default_factory=dict,
        description="The step's fast paths as they ran on the training host (fused loss, compile, Liger, LoRA "
        "compute dtype, activation checkpointing).",
    )
