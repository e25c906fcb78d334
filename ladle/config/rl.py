"""Config of online RL (``training.objective: grpo``): the rewards, the group and the loss, and the episodes of
an agent that calls tools (``training.rl.environment``, ``training.rl.episode``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from ladle.section import Section

BUILTIN_REWARDS = ("exact_match", "json_schema", "regex", "length", "env_reward")
"""Rewards ladle ships (``ladle.rewards``), named in ``training.rl.rewards`` by these names."""


class RewardConfig(Section):
    """One reward function of ``training.rl.rewards``: a TRL-style callable, or one of ladle's built-ins."""

    fn: str = Field(
        description="`path/to/file.py:function` (the file travels with the run), `package.module:function`, or a "
        "built-in: `exact_match` (the completion, stripped, equals a column; `column`), `json_schema` (the "
        "completion parses as JSON and validates against `schema`, or the JSON schema in a column), `regex` (the "
        "completion matches `pattern` from its start), `length` (-(tokens beyond `max_tokens`) / max_tokens, 0 "
        "within it), `env_reward` (a gym-style training.rl.environment's own rewards of the episode, summed, or "
        "what an agent program returned). A function is called as TRL calls it: `fn(prompts=..., completions=..., "
        "completion_ids=..., **columns)`, returning one float (or None: not applicable) per completion."
    )
    weight: float = Field(1.0, description="Weight of this reward in the sum each completion is scored by.")
    args: dict[str, Any] = Field(
        default_factory=dict,
        description="Built-ins' settings: exact_match {column}; json_schema {schema | column}; regex {pattern}; "
        "length {max_tokens}. Empty for a user function.",
    )


class EpisodeConfig(Section):
    """How long an agent's episode may run (``training.rl.environment``): its turns, each turn's tokens
    (``training.rl.max_completion_tokens``), and what a tool may take and give back."""

    max_turns: int = Field(
        4,
        ge=1,
        le=64,
        description="Model turns per episode at most: an episode whose last turn still calls tools ends there, "
        "marked max_turns (its calls are not run).",
    )
    tool_timeout_s: float = Field(
        10.0,
        gt=0.0,
        le=600.0,
        description="Seconds one tool call may take; a call past it is killed with its process and its episode "
        "ends, marked tool_timeout.",
    )
    max_tool_result_tokens: int = Field(
        256,
        ge=8,
        le=32768,
        description="Tokens one turn of tool results may take, chat template included; a bigger result ends its "
        "episode, marked tool_result_too_long (never cut silently).",
    )
    program_timeout_s: float = Field(
        300.0,
        gt=0.0,
        le=3600.0,
        description="Seconds an agent program (an environment that is a function) may take for one batch of "
        "episodes, its own tools and the policy's turns included; a program still running is killed with its "
        "process and its episode ends, marked program_timeout.",
    )


class RLConfig(Section):
    """Online reinforcement learning from checkable rewards (``training.objective: grpo``): the group of
    completions sampled per prompt by ladle's own batching engine on the policy's live weights, the rewards
    that score them, and the loss. Defaults are TRL 1.16's ``GRPOConfig``'s."""

    num_generations: int = Field(
        8, ge=1, le=1024, description="Completions sampled per prompt (the group whose rewards are compared)."
    )
    max_completion_tokens: int = Field(
        512, ge=1, le=131072, description="Tokens sampled per completion at most (TRL's max_completion_length)."
    )
    temperature: float = Field(1.0, ge=0.0, le=10.0, description="Sampling temperature of the rollouts.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling of the rollouts. 1: off.")
    top_k: int = Field(0, ge=0, description="Sample among the k likeliest tokens only. 0: off.")
    loss: Literal["grpo", "dr_grpo", "dapo", "cispo", "sapo"] = Field(
        "dapo",
        description="As TRL defines them. grpo: each completion's token mean, then the mean over completions; "
        "dr_grpo: tokens summed over (completions x max_completion_tokens); dapo: the token mean over the whole "
        "step; cispo: the clipped importance weight (not its gradient) times the log-probability (MiniMax-M1); "
        "sapo: a sigmoid-softened trust region instead of clipping. TRL's bnpo normalises by each process's "
        "micro-batch and so changes with the world size; dapo is its step-wide form.",
    )
    importance_sampling: Literal["token", "sequence"] = Field(
        "token",
        description="token: a ratio per token (GRPO); sequence: the completion's mean log-ratio as one ratio for "
        "all its tokens (GSPO).",
    )
    beta: float = Field(
        0.0, ge=0.0, le=100.0, description="Weight of the KL to the reference (k3 estimator). 0: no reference pass."
    )
    epsilon: float = Field(0.2, gt=0.0, lt=1.0, description="Lower clipping bound: ratios below 1 - epsilon clip.")
    epsilon_high: float | None = Field(
        None, gt=0.0, description="Upper clipping bound (DAPO's clip-higher; cispo: the ratio cap). null: epsilon."
    )
    sapo_temperature_pos: float = Field(1.0, gt=0.0, description="sapo: softness for positive advantages.")
    sapo_temperature_neg: float = Field(1.05, gt=0.0, description="sapo: softness for negative advantages.")
    num_iterations: int = Field(
        1, ge=1, le=64, description="Policy updates per batch of rollouts (TRL's mu); above 1 the ratios move."
    )
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group",
        description="Advantages = reward - its group's mean, divided by the group's standard deviation (group), "
        "the whole step's (batch), or not divided (none, Dr. GRPO).",
    )
    rewards: list[RewardConfig] = Field(
        default_factory=list,
        description="Reward functions, summed with their weights. A bare string is {fn: STRING}.",
    )
    merge_for_rollouts: bool | None = Field(
        None,
        description="LoRA: the engine samples with each adapted layer's weight and its adapter summed into one "
        "matrix, made afresh from the live tensors at each step's rollouts and freed after (the adapter's two "
        "extra products a layer cost a quarter of a decode step on a CPU); it holds a copy of the adapted "
        "weights meanwhile. null: on where the plan fits with that copy, off where it does not (the plan says "
        "which, in GiB). Full fine-tunes have nothing to merge.",
    )
    probe_every: int = Field(
        5,
        ge=0,
        description="Steps between checks of the general-ability probe (eval.probe) on the live policy during "
        "training: its trend goes to the report and MLflow (`probe`), and probe_guard acts on it. 0: no checks "
        "during training (the evaluation stage still gates on it).",
    )
    probe_guard: Literal["restore", "report"] = Field(
        "restore",
        description="With eval.probe and promote.max_probe_drop: restore: a check that finds the probe more than "
        "max_probe_drop below its start ends the run with the adapter of the last check within it (LoRA under ddp, "
        "zero1, zero2; elsewhere the run ends at the breach, which the gate then refuses); report: only reported.",
    )
    logprob_check_every: int = Field(
        1,
        ge=0,
        description="Steps between checks of the sampler against the trainer: the engine's log-probabilities of "
        "the tokens it sampled beside the training forward's on the same tokens, logged as rollout_logprob_gap "
        "(the largest absolute difference). 0: never.",
    )

    environment: str | None = Field(
        None,
        description="Train an agent: each completion becomes an episode in which the model calls tools, reads "
        "their results and answers, rolled out through the chat template and the tool-call parser ladle serves "
        "with, the loss on the model's own tokens only. `calculator` (built-in: arithmetic), "
        "`package.module:Class` or `path/to/file.py:Class` (the file travels with the run): TRL's "
        "environment_factory convention, a class whose public methods are the tools (typed arguments and a "
        "docstring with an Args section), or gym-style, a class with step(action) that takes each turn's text and "
        "returns the observation (or observation, reward, done); either with an optional reset(**columns) whose "
        "text, if any, is added to the prompt's last user turn. Tools and steps run in a subprocess. Or an agent "
        "program (verifiers', NeMo Gym's, ART's shape): a function program(client, model, messages, **columns), "
        "plain or async, that plays one episode with the OpenAI SDK's client against ladle's endpoint of the live "
        "policy and may return its reward (env_reward); it runs in a subprocess, every call's tokens recorded. "
        "null: one completion per prompt.",
    )
    episode: EpisodeConfig = Field(
        default_factory=EpisodeConfig,
        description="Episodes of training.rl.environment: turns, tool limits and an agent program's deadline.",
    )

    @field_validator("rewards", mode="before")
    @classmethod
    def _strings_are_functions(cls, value: object) -> object:
        if isinstance(value, list):
            return [{"fn": item} if isinstance(item, str) else item for item in value]
        return value

    @property
    def completion_budget(self) -> int:
        """Tokens after the prompt at most: one completion's, or an agent's episode's (every turn's and every tool
        block between them: what the planner sizes and dr_grpo normalises by, TRL's max_completion_length)."""
        if not self.environment:
            return self.max_completion_tokens
        turns = self.episode.max_turns
        return turns * self.max_completion_tokens + (turns - 1) * self.episode.max_tool_result_tokens

    @property
    def clip_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high
