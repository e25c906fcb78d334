"""Online RL (``training.objective: grpo``): the loss against TRL's own ``GRPOTrainer``, the rewards as TRL calls
them, and real runs whose rollouts come from ladle's engine on the live weights.

On a fixed batch of prompts, completions, advantages and old/reference log-probabilities, ladle's loss and LoRA
gradients equal ``GRPOTrainer._compute_loss`` (trl 1.16, float32, 1e-5 relative) for every loss type ladle
offers, with token- and sequence-level (GSPO) importance sampling and with the KL term. The runs share one launch
of 2 processes (DDP and ZeRO-2 beside one process), a resume, and the refusals.
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest
import torch

from ladle import rewards as reward_fns
from ladle.config import build_config
from ladle.config.training import RLConfig
from ladle.errors import ConfigError
from ladle.platform import storage
from ladle.train import grpo
from tests.helpers import launch_all
from tests.train.test_preference import tiny_lora_model, word_tokenizer

PROMPTS = [[1, 5, 6, 7], [1, 11, 12]]  # two prompts, two completions each (EOS = 2 ends a completion)
COMPLETIONS = [[8, 9, 2], [10, 2], [13, 14, 15, 16], [17, 2]]
MAX_COMPLETION = 4
# An agent's episodes (training.rl.environment): 0 on tokens the tools' blocks put there, which the loss skips.
TOOL_MASKS = [[1, 0, 1], [1, 1], [1, 0, 0, 1], [0, 1]]
TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def trl_trainer(tmp_path_factory):
    """TRL's GRPOTrainer over a LoRA model whose adapters are not zero (so the gradients are not trivial)."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=str(tmp_path_factory.mktemp("trl")),
        report_to=[],
        use_cpu=True,
        per_device_train_batch_size=len(COMPLETIONS),
        num_generations=2,
        max_completion_length=MAX_COMPLETION,
        temperature=TEMPERATURE,
        bf16=False,
    )
    trainer = GRPOTrainer(
        model=tiny_lora_model(),
        reward_funcs=[lambda prompts, completions, **kwargs: [0.0] * len(prompts)],
        args=args,
        train_dataset=Dataset.from_list([{"prompt": "5 6 7"}] * 4),  # never read: the batch below
        processing_class=word_tokenizer(),
    )
    trainer.current_gradient_accumulation_steps = 1
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in trainer.model.named_parameters():
            if "lora_B" in name:
                param.add_(0.3 * torch.randn(param.shape, generator=g))
    return trainer


def fixed_batch():
    """The batch both sides score: rows, advantages, and old and reference log-probabilities a little off the
    policy's (so ratios clip and the KL is not zero)."""
    rows = [{"ids": PROMPTS[i // 2], "prompt": "p", "columns": {}} for i in range(len(COMPLETIONS))]
    ids, mask, cmask, width = grpo.batch_inputs(rows, COMPLETIONS, 0, "cpu")
    g = torch.Generator().manual_seed(7)
    adv = torch.tensor([1.2, -1.2, 0.7, -0.7])
    shift = 0.4 * torch.randn(cmask.shape, generator=g)
    return rows, ids, mask, cmask, width, adv, shift


def tool_mask(cmask: torch.Tensor) -> torch.Tensor:
    return grpo.Rollouts([], COMPLETIONS, [], [], masks=TOOL_MASKS).loss_mask(list(range(len(COMPLETIONS))), cmask)


def trl_loss_and_grads(trainer, rl: RLConfig, old: torch.Tensor | None, ref: torch.Tensor | None, tools: bool = False):
    trainer.loss_type, trainer.importance_sampling_level, trainer.beta = rl.loss, rl.importance_sampling, rl.beta
    trainer.epsilon_low, trainer.epsilon_high = rl.epsilon, rl.clip_high
    trainer.args.sapo_temperature_pos, trainer.args.sapo_temperature_neg = (
        rl.sapo_temperature_pos,
        rl.sapo_temperature_neg,
    )
    rows, ids, mask, cmask, width, adv, _ = fixed_batch()
    inputs = {
        "prompt_ids": ids[:, :width],
        "prompt_mask": mask[:, :width],
        "completion_ids": ids[:, width:],
        "completion_mask": cmask.long(),
        "advantages": adv,
        "num_items_in_batch": cmask.sum(),
    }
    if tools:  # TRL's multi-turn layout: tool_mask beside completion_mask, the loss on their product
        padded = torch.ones_like(cmask, dtype=torch.long)
        for i, m in enumerate(TOOL_MASKS):
            padded[i, : len(m)] = torch.tensor(m)
        inputs["tool_mask"] = padded
        inputs["num_items_in_batch"] = (cmask * padded).sum()
    if old is not None:
        inputs["old_per_token_logps"] = old
    if ref is not None:
        inputs["ref_per_token_logps"] = ref
    model = trainer.model
    model.zero_grad(set_to_none=True)
    value = trainer._compute_loss(model, inputs)
    value.backward()
    return float(value), grads(model)


def ladle_loss_and_grads(
    model,
    rl: RLConfig,
    old: torch.Tensor | None,
    ref: torch.Tensor | None,
    share: bool,
    packed: bool = False,
    tools: bool = False,
):
    """ladle's loss and gradients on the fixed batch; ``share``: each group's prompt run once (the update's path),
    else every completion with its own copy of the prompt (TRL's); ``packed``: the shared prompts' completions
    scored as one row of their real tokens (``training.kernels.padding_free``, the update's default)."""
    rows, ids, mask, cmask, width, adv, _ = fixed_batch()
    model.zero_grad(set_to_none=True)
    logps, scored = grpo.completion_logps(model, rows, COMPLETIONS, 0, "cpu", rl.temperature, share, packed)
    assert torch.equal(scored, cmask)
    if tools:  # as the update masks an agent's episodes (Rollouts.loss_mask)
        cmask = tool_mask(cmask)
    per_token, stats = grpo.per_token_loss(logps, logps.detach() if old is None else old, adv, cmask, rl, ref)
    value = grpo.reduce(per_token, cmask, rl, len(COMPLETIONS), int(cmask.sum()))
    value.backward()
    # The same reduction of the terms' sizes: what a float32 sum's rounding scales with (the loss itself is a sum of
    # terms of both signs, so it can be far smaller than its rounding error; docs/guide/testing.md).
    magnitude = float(grpo.reduce(per_token.detach().abs(), cmask, rl, len(COMPLETIONS), int(cmask.sum())))
    clip_ratio = stats["clipped"] / float(cmask.sum()) if "clipped" in stats else None
    return float(value), grads(model), magnitude, clip_ratio


def trl_clip_ratio(trainer, rl: RLConfig) -> float | None:
    """The clip ratio TRL logged for its last loss (``clip_ratio/region_mean``; cispo's own; none for sapo)."""
    metrics = trainer._metrics["train" if trainer.model.training else "eval"]
    name = {"cispo": "cispo_clip_ratio", "sapo": None}.get(rl.loss, "clip_ratio/region_mean")
    return metrics[name][-1] if name else None


def grads(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


FLOAT32_SUMS = 1e-5  # a float32 sum of n ~ 1e2-1e3 terms, summed in another order: ~sqrt(n) * 1.2e-7 of their sizes
CASES = {
    "dapo": {},
    "grpo": {"loss": "grpo"},
    "dr_grpo": {"loss": "dr_grpo"},
    "gspo": {"loss": "grpo", "importance_sampling": "sequence"},
    "cispo": {"loss": "cispo", "epsilon_high": 1.1},
    "sapo": {"loss": "sapo"},
    "dapo+kl+clip_higher": {"beta": 0.04, "epsilon_high": 0.28},
    "dapo+tools": {},
    "grpo+tools": {"loss": "grpo"},
    "dr_grpo+tools": {"loss": "dr_grpo"},
    "gspo+kl+tools": {"loss": "grpo", "importance_sampling": "sequence", "beta": 0.04},
}


@pytest.mark.parametrize("case", list(CASES))
def test_loss_and_lora_gradients_equal_trl_grpo_trainer(trl_trainer, case):
    rl = RLConfig(temperature=TEMPERATURE, max_completion_tokens=MAX_COMPLETION, **CASES[case])
    tools = case.endswith("+tools")
    model = trl_trainer.model
    _, ids, mask, cmask, width, _, shift = fixed_batch()
    with torch.no_grad():
        current = grpo.token_logps(model, ids, mask, width, TEMPERATURE)
    old = (current - shift) * cmask  # ratios away from 1: some clip
    ref = (current + shift.flip(0)) * cmask if rl.beta else None
    expected, expected_grads = trl_loss_and_grads(trl_trainer, rl, old, ref, tools)
    expected_clip = trl_clip_ratio(trl_trainer, rl)
    # The batch clips some tokens, not all (a sequence's mean ratio stays within gspo's bounds here).
    assert expected_clip is None or 0 < expected_clip < 1 or (expected_clip == 0 and case.startswith("gspo"))
    for share, packed in ((True, True), (True, False), (False, False)):
        value, got, magnitude, clip_ratio = ladle_loss_and_grads(model, rl, old, ref, share, packed, tools)
        assert value == pytest.approx(expected, abs=FLOAT32_SUMS * magnitude), (share, packed)
        assert clip_ratio == (None if expected_clip is None else pytest.approx(expected_clip, abs=1e-6))
        assert expected_grads.keys() == got.keys() and got
        for name, grad in expected_grads.items():
            # float32 sums in another order (shared prompts reach the completions through the cache; the masks and
            # the sequence-level ratio sum other terms): each gradient within 1e-5 of its tensor's scale (measured
            # up to ~1e-6 shared, ~4e-7 unshared; docs/guide/testing.md).
            atol = FLOAT32_SUMS * float(grad.abs().max())
            torch.testing.assert_close(
                got[name], grad, rtol=1e-5, atol=atol, msg=f"{name} (shared prompts: {share}, packed: {packed})"
            )


@pytest.mark.parametrize("seed", [0, 42, 20261205, 123456789, 2**63 - 1])
def test_completion_seeds_fit_every_generator_for_any_run_seed(seed):
    seeds = grpo.seeds_for(seed, 7, range(64))
    assert seeds == grpo.seeds_for(seed, 7, range(64)), "the same on every attempt"
    assert len(set(seeds)) == 64 and not set(seeds) & set(grpo.seeds_for(seed, 8, range(64)))
    for value in seeds:
        assert 0 <= value < 2**63
        torch.Generator().manual_seed(value)  # raised RuntimeError for training.seed >= ~1.85e7


def test_a_seed_no_generator_takes_is_refused_naming_the_field():
    for seed in (-1, 2**63):
        with pytest.raises(ConfigError, match="training.seed"):
            build_config({"base": "ladle://tiny-llama", "data": {"path": "x.jsonl"}}, [f"training.seed={seed}"])


def test_advantages_are_trls_group_normalised_rewards_and_none_is_excluded():
    table = torch.tensor([[1.0, float("nan")], [0.0, 1.0], [0.5, float("nan")], [float("nan"), float("nan")]])
    adv, summed = grpo.advantages(table, torch.tensor([1.0, 2.0]), group=2, scale="group")
    assert summed[:3].tolist() == [1.0, 2.0, 0.5] and torch.isnan(summed[3])
    std = float(torch.tensor([1.0, 2.0]).std())  # Bessel-corrected, as TRL's nanstd
    assert adv[:2].tolist() == pytest.approx([(-0.5) / (std + 1e-4), 0.5 / (std + 1e-4)])
    assert adv[2:].tolist() == [0.0, 0.0]  # a lone scorable completion, and one no reward applies to
    flat, _ = grpo.advantages(table[:2], torch.tensor([1.0, 2.0]), group=2, scale="none")
    assert flat.tolist() == pytest.approx([-0.5, 0.5])


# Rewards ---------------------------------------------------------------------------------------------------------


def test_a_reward_written_for_trl_runs_unchanged_with_the_datas_columns(tmp_path):
    source = (
        "def exact(prompts, completions, answer, **kwargs):\n"
        "    return [1.0 if c[0]['content'].strip() == a else 0.0 for c, a in zip(completions, answer)]\n"
        "def named_only(completions, answer):\n"
        "    return [float(len(c) == len(a)) for c, a in zip(completions, answer)]\n"
    )
    (tmp_path / "my_rewards.py").write_text(source)
    cfg = RLConfig(rewards=["my_rewards.py:exact", "my_rewards.py:named_only"]).rewards
    files = reward_fns.bundle(cfg, root=tmp_path)
    assert files == {"my_rewards.py": source}
    loaded = reward_fns.load_all(cfg, files)
    completions = [[{"role": "assistant", "content": " 4 "}], [{"role": "assistant", "content": "5"}]]
    assert loaded[0](["q", "q"], completions, [[1], [2]], {"answer": ["4", "4"]}) == [1.0, 0.0]
    assert reward_fns.columns_needed(cfg, files) is None  # exact takes **kwargs: every column
    assert reward_fns.columns_needed(cfg[1:], files) == ["answer"]
    assert reward_fns.digest(files, cfg) != reward_fns.digest({"my_rewards.py": source + "#"}, cfg)


def test_a_rewards_optional_parameters_are_not_demanded_and_it_gets_trls_trainer_state(tmp_path):
    """A parameter with a default is a column passed when the data has it, never one every row must have; a reward
    naming ``trainer_state`` receives a ``transformers.TrainerState`` at the step being taken, as TRL passes it."""
    source = (
        "def scaled(completions, answer, bonus=None, trainer_state=None):\n"
        "    late = trainer_state.global_step / trainer_state.max_steps\n"
        "    extra = bonus or [0.0] * len(completions)\n"
        "    return [late * float(c == a) + b for c, a, b in zip(completions, answer, extra)]\n"
    )
    (tmp_path / "r.py").write_text(source)
    cfg = RLConfig(rewards=["r.py:scaled"]).rewards
    files = reward_fns.bundle(cfg, root=tmp_path)
    assert reward_fns.columns_needed(cfg, files) == ["answer"]  # not bonus, not trainer_state
    (scaled,) = reward_fns.load_all(cfg, files)
    state = reward_fns.trainer_state(3, 4)
    assert scaled(["p", "p"], ["4", "5"], [[1], [2]], {"answer": ["4", "4"]}, state) == [0.75, 0.0]
    assert scaled(["p"], ["4"], [[1]], {"answer": ["4"], "bonus": [1.0]}, state) == [1.75]  # the column given


def test_built_in_rewards():
    made = RLConfig(
        rewards=[
            {"fn": "exact_match", "args": {"column": "answer"}},
            {"fn": "regex", "args": {"pattern": r"\d+$"}},
            {"fn": "json_schema", "args": {"schema": {"type": "object", "required": ["a"]}}},
            {"fn": "length", "args": {"max_tokens": 2}},
        ]
    ).rewards
    exact, regex, schema, length = reward_fns.load_all(made, {})
    texts = ["42", '{"a": 1}', "x 7"]
    assert exact(texts, texts, [[1]] * 3, {"answer": ["42", "{}", "x"]}) == [1.0, 0.0, 0.0]
    assert regex(texts, texts, [[1]] * 3, {}) == [1.0, 0.0, 0.0]
    assert schema(texts, texts, [[1]] * 3, {}) == [0.0, 1.0, 0.0]
    assert length(texts, texts, [[1], [1, 2, 3], [1, 2, 3, 4]], {}) == [0.0, -0.5, -1.0]


def test_a_reward_that_raises_on_one_completion_scores_it_none_and_counts_it():
    """One model output cannot end a run: a JSON nested past the recursion limit, a row whose schema is not a
    schema, a user's function that trips on one completion each score None there, counted; numpy's values (as TRL
    rewards return them) are numbers."""
    import numpy as np

    made = RLConfig(rewards=[{"fn": "json_schema", "args": {"column": "schema"}}]).rewards
    (schema,) = reward_fns.load_all(made, {})
    texts = ["[" * 100_000 + "]" * 100_000, '{"a": 1}', '{"a": 1}']
    good = {"type": "object", "required": ["a"]}
    values = schema(texts, texts, [[1]] * 3, {"schema": [good, {"type": 12}, good]})
    assert values == [None, None, 1.0] and schema.take_failed() == 2 and schema.failed == 0

    def picky(prompts, completions, **kwargs):
        return np.array([1.0 / len(c) for c in completions], dtype=np.float32)  # "" raises ZeroDivisionError

    user = reward_fns.Reward("picky", 1.0, picky, True, frozenset())
    assert user(["p", "p"], ["ab", ""], [[1], [2]], {}) == [0.5, None] and user.take_failed() == 1
    with pytest.raises(reward_fns.RewardError, match=r"picky raised ZeroDivisionError: .* every one of its 2"):
        user(["p", "q"], ["", ""], [[1], [2]], {})


@pytest.mark.parametrize(
    ("source", "entry", "message"),
    [
        (None, "no_such_module_here:fn", "cannot import it (ModuleNotFoundError"),
        ("def f(x):\n    return [0.0]\n", "r.py:f", "has the signature (x); a reward is called as TRL calls it"),
        (
            "def f(prompts, completions, **k):\n    raise ValueError('boom')\n",
            "r.py:f",
            "f raised ValueError: boom on every one of its 2 completions (the first: row 0, prompt 'p')",
        ),
        ("def f(prompts, completions, **k):\n    return [1.0]\n", "r.py:f", "f returned 1 values for 2 completions"),
        ("def f(prompts, completions, **k):\n    return ['a', 1]\n", "r.py:f", "f returned 'a' for completion 0"),
        ("def g(prompts, completions, **k):\n    return []\n", "r.py:f", "r.py has no function 'f'"),
        (None, "exact_match", "exact_match has args {}; it takes args: {column: NAME}"),
    ],
)
def test_a_bad_reward_is_one_error_naming_it(tmp_path, source, entry, message):
    files = {"r.py": source} if source else {}
    cfg = RLConfig(rewards=[entry]).rewards
    with pytest.raises(reward_fns.RewardError) as caught:
        reward_fns.load_all(cfg, files)[0](["p", "p"], ["a", "b"], [[1], [2]], {})
    assert message in str(caught.value)
    assert str(caught.value).startswith("training.rl.rewards")


def test_config_refuses_what_cannot_learn():
    base = {"base": "ladle://tiny-llama", "data": {"path": "x.jsonl"}}
    cases = {
        "training.rl.temperature = 0 with training.rl.num_generations = 4": {"temperature": 0, "num_generations": 4},
        "training.rl.rewards = []: grpo needs at least one reward": {"rewards": []},
        "training.rl.loss = cispo with training.rl.epsilon_high = null": {"loss": "cispo"},
    }
    for message, rl in cases.items():
        rl = {"rewards": ["exact_match"], **rl}
        with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
            build_config({**base, "training": {"objective": "grpo", "rl": rl}}, [])
    with pytest.raises(ConfigError, match="training.global_batch_size = 10: with grpo it counts completions"):
        build_config(
            {**base, "training": {"objective": "grpo", "global_batch_size": 10, "rl": {"rewards": ["x:y"]}}}, []
        )
    with pytest.raises(ConfigError, match="eval.metric = reward with training.objective = sft"):
        build_config({**base, "eval": {"metric": "reward"}}, [])


# Runs ------------------------------------------------------------------------------------------------------------

REWARD_FILE = (  # the random tiny model's completions differ in it from the first step: every group has a signal
    "def digits(prompts, completions, **kwargs):\n"
    "    texts = [c[0]['content'] for c in completions]\n"
    "    return [sum(ch.isdigit() for ch in t) / max(1, len(t)) for t in texts]\n"
)


def prompt_file(root: Path) -> Path:
    from ladle.assets.demo import demo_rows

    path = root / "prompts.jsonl"
    rows = demo_rows(96)
    lines = [
        {"prompt": [{"role": "user", "content": f"{r['instruction']}\n{r['input']}"}], "answer": r["output"]}
        for r in rows
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def grpo_spec(strategy: str, root: Path, *overrides: str, processes: int = 2):
    from tests.helpers import train_spec

    (root / "digits.py").write_text(REWARD_FILE)
    cfg = build_config(
        {
            "base": "ladle://tiny-llama",
            "data": {"path": str(prompt_file(root)), "seq_len": 64},
            "parallelism": {"strategy": strategy, "cpu_processes": processes},
            "training": {
                "objective": "grpo",
                "max_steps": 4,
                "checkpoint_every": 2,
                "lr": 1e-2,
                "scheduler": "constant",
                "micro_batch_size": 4,
                "global_batch_size": 16,
                "lora": {"target_modules": "all-linear", "modules_to_save": ["lm_head"]},
                "rl": {
                    "num_generations": 4,
                    "max_completion_tokens": 8,
                    "rewards": [
                        str(root / "digits.py") + ":digits",
                        {"fn": "exact_match", "args": {"column": "answer"}},
                    ],
                },
            },
        },
        list(overrides),
    )
    spec = train_spec(cfg, root, f"{strategy}-{processes}" + "".join(overrides))
    return spec.model_copy(update={"reward_files": reward_fns.bundle(cfg.training.rl.rewards)})


LARGE_SEED = "training.seed=123456789"
FULL = ("training.lora.enabled=false", "training.rl.beta=0.04", "training.lr=1e-3")  # a full fine-tune with a KL


def test_rollouts_by_the_engine_match_the_trainer_ranks_agree_and_a_resume_samples_the_same(tmp_path):
    """One process and two under ZeRO-2 sample the same completions (each one's seed is its index in the step) and
    reach the same losses; so do a full fine-tune with a KL term on one process and on two under ZeRO-3 and FSDP2,
    whose trained weights are gathered for the rollouts and whose reference is a frozen copy sharded as they are;
    the engine's log-probabilities of what it sampled equal the training forward's on the same weights; the one
    process's step-2 checkpoint resumed on two processes samples and learns what the first run did, and a reward
    that raises stops it with the reward named and that checkpoint kept."""
    from ladle.train.checkpoint import complete_steps, step_dir
    from ladle.train.run import TrainingFailed, launch

    specs = {  # a seed past 1.85e7, where the completions' seeds once overflowed torch's generator
        "one": grpo_spec("ddp", tmp_path, LARGE_SEED, processes=1),
        "zero2": grpo_spec("zero2", tmp_path, LARGE_SEED),
        "one_full": grpo_spec("ddp", tmp_path, *FULL, processes=1),  # the reference: a copy of the replica
        "zero3": grpo_spec("zero3", tmp_path, *FULL),  # every weight gathered for the rollouts, partitioned after
        # Every unit unsharded for the rollouts, resharded after; each rank's two micro-batches reduce-scattered
        # one by one, the gradients accumulating sharded (tests/train/test_strategies.py holds them unsharded).
        "fsdp2": grpo_spec("fsdp2", tmp_path, *FULL, "parallelism.fsdp2.gradient_sync=each_microbatch"),
    }
    results = launch_all(specs)
    one, two, full = results["one"], results["zero2"], results["one_full"]
    assert one.world_size == 1 and two.world_size == 2 and two.strategy == "zero2"
    assert all(loss != 0 for loss in one.train_losses)  # every step's groups' rewards differed
    for sharded, alone in (("zero2", one), ("zero3", full), ("fsdp2", full)):
        assert results[sharded].rl["rollout_logprob_gap_max"] < 1e-4
        assert results[sharded].train_losses == pytest.approx(alone.train_losses, rel=1e-4, abs=1e-6), sharded
    # The KL term was live (the policy had moved from its reference) and measured the same against the copy of the
    # replica and against the sharded copies.
    assert full.rl["kl_last_step"] > 1e-6 and "kl_last_step" not in one.rl
    for sharded in ("zero3", "fsdp2"):
        assert results[sharded].rl["kl_last_step"] == pytest.approx(full.rl["kl_last_step"], rel=1e-3), sharded
        assert results[sharded].kernels["reference"] == "a frozen copy, sharded as the trained weights"
    assert full.kernels["reference"] == "a frozen copy"
    assert one.rl["rollout_logprob_gap_max"] < 1e-4
    assert results["zero3"].sharding["parameter_share"] == pytest.approx(0.5, abs=0.02)  # partitioned between
    for sharded in ("zero3", "fsdp2"):
        assert results[sharded].kernels["rollouts"].endswith("gathered whole for each step's rollouts")
    assert results["fsdp2"].sharding["parameter_share"] == pytest.approx(0.5, abs=0.02)
    assert results["fsdp2"].sharding["gradient_sync"] == "each_microbatch"
    # LoRA's rollouts sampled with the adapters merged (auto: the copy fits), within 1e-4 of the trainer's forward
    # through the adapters (checked above); the full fine-tunes have none to merge.
    for lora in (one, two):
        assert lora.kernels["rollouts"].endswith("each adapted layer's weight and adapter merged into one matrix")
        assert lora.kernels["merged_layers"] == str(4 * 7)  # every linear layer of the tiny model's 4, not its head
    assert "merged_layers" not in full.kernels
    # Every update scored its completions as one row of their real tokens (auto: plain attention, nothing
    # recomputed), under each strategy, and still reached one process's losses (above).
    for result in results.values():
        assert result.kernels["padding_free"].startswith("on: each micro-batch's completions as one row")
    assert one.kernels["rollouts"].startswith("ladle's batching engine on the live weights")
    assert one.adapter_url and one.rl["eval_reward_after"] != one.rl["eval_reward_before"]

    root = storage.join(specs["one"].run_url, "checkpoints")
    assert complete_steps(root) == [2, 4]
    # A checkpoint keeps the run's running figures, so a resumed run reports its first step's reward, its largest
    # sampler-trainer gap and its last KL as the uninterrupted one does (they were lost on resume).
    kept = torch.load(io.BytesIO(storage.read_bytes(storage.join(step_dir(root, 4), "state.pt"))), weights_only=True)
    assert kept["extra"]["reward_first"] == pytest.approx(one.rl["reward_first_step"])
    assert kept["extra"]["gap_max"] == pytest.approx(one.rl["rollout_logprob_gap_max"])
    # The one process's step-2 checkpoint resumed on two (DDP, the same global batch of completions), with a reward
    # that breaks at its second call (step 4): step 3 is sampled and learned as the first time, then the run stops
    # with the reward named, its step-2 checkpoint kept.
    broken = grpo_spec("ddp", tmp_path, LARGE_SEED, processes=2).model_copy(deep=True)
    root = storage.join(broken.run_url, "checkpoints")
    storage.upload_dir(step_dir(storage.join(specs["one"].run_url, "checkpoints"), 2), step_dir(root, 2))
    (path,) = list(broken.reward_files)
    broken.reward_files[path] = REWARD_FILE.replace(
        "    texts =", "    CALLS.append(1)\n    if len(CALLS) >= 2:\n        raise KeyError('score')\n    texts ="
    ).replace("def digits", "CALLS = []\ndef digits")
    steps: list[dict] = []
    with pytest.raises(
        TrainingFailed, match=r"training.rl.rewards: digits raised KeyError: 'score' on every one of its 8 completions"
    ) as failed:
        launch(broken, on_progress=lambda e: steps.append(e) if e["event"] == "step" else None)
    last = str(failed.value).splitlines()[-1]  # what a user reads first: the cause, not the launcher's exit lines
    assert "digits raised KeyError: 'score' on every one of its 8 completions (the first: row 0, prompt" in last
    assert [e["step"] for e in steps] == [3]
    assert steps[0]["loss"] == pytest.approx(one.train_losses[2], rel=1e-4, abs=1e-6)
    assert complete_steps(root) == [2]


def sharded_cfg(cfg, strategy: str):
    return build_config(cfg.model_dump(mode="json"), [f"parallelism.strategy={strategy}"])


def test_planner_gathers_sharded_weights_for_rollouts_and_refuses_what_cannot_sample(tmp_path):
    from ladle.machine.topology import probe
    from ladle.plan.memory import plan_estimate
    from ladle.plan.planner import make_plan

    model = json.loads((Path(grpo_spec("ddp", tmp_path).base_dir) / "config.json").read_text())
    cfg = grpo_spec("ddp", tmp_path).config
    bad = build_config(cfg.model_dump(mode="json"), ["parallelism.strategy=tp"])
    with pytest.raises(ConfigError, match="training.objective = grpo with parallelism.strategy = tp"):
        make_plan(bad, probe(env={}, query_output=""), model=model)
    full = build_config(
        cfg.model_dump(mode="json"),
        ["parallelism.strategy=zero3", "training.lora.enabled=false", "training.rl.beta=0.04"],
    )
    full_plan = make_plan(full, probe(env={}, query_output=""), model=model)  # the KL's reference sharded too
    said = next(r for r in full_plan.reasons if r.startswith("KL reference:"))
    assert "sharded by zero3 as the trained ones are" in said and "per rank" in said, said
    plan = make_plan(cfg, probe(env={}, query_output=""), model=model)
    assert any(r.startswith("rollout memory per rank: KV cache") for r in plan.reasons)
    # LoRA's rollouts sample with the adapters merged into a copy of the adapted weights where it fits (here), and
    # the copy is sized with the rollouts; asked off, neither.
    said = next(r for r in plan.reasons if r.startswith("rollouts sample with"))
    assert plan.merged_rollouts and "a copy of the adapted weights with their adapters merged" in said, said
    assert "(auto: the plan needs" in said and "usable a rank)" in said, said
    unmerged_cfg = build_config(cfg.model_dump(mode="json"), ["training.rl.merge_for_rollouts=false"])
    unmerged = make_plan(unmerged_cfg, probe(env={}, query_output=""), model=model)
    assert not unmerged.merged_rollouts
    from ladle.sizing.params import lora_base_params

    adapted = lora_base_params(model, "all-linear") * 4
    assert plan_estimate(cfg, plan, model).rollout - plan_estimate(unmerged_cfg, unmerged, model).rollout == adapted
    # The completions run as one row on their prompts' keys and values, which recomputed layers do not keep.
    recomputed = build_config(
        cfg.model_dump(mode="json"), ["training.kernels.padding_free=true", "training.gradient_checkpointing=true"]
    )
    with pytest.raises(
        ConfigError,
        match=r"training.kernels.padding_free = true with training.gradient_checkpointing = true under grpo.*"
        r"Set training.kernels.padding_free=auto or training.gradient_checkpointing=false",
    ):
        make_plan(recomputed, probe(env={}, query_output=""), model=model)
    with pytest.raises(ConfigError, match="training.rl.merge_for_rollouts = true: a full fine-tune"):
        make_plan(
            build_config(
                cfg.model_dump(mode="json"), ["training.lora.enabled=false", "training.rl.merge_for_rollouts=true"]
            ),
            probe(env={}, query_output=""),
            model=model,
        )
    zero3 = make_plan(
        build_config(cfg.model_dump(mode="json"), ["parallelism.strategy=zero3"]),
        probe(env={}, query_output=""),
        model=model,
    )
    said = next(r for r in zero3.reasons if r.startswith("rollout weights:"))
    assert "zero3 gathers every weight whole on each rank while it samples" in said
    assert re.search(r"\d+\.\d (GiB|MiB) per rank", said), said
    assert zero3.strategy_options["shard_head"] is False  # the ends whole too: the engine samples on them
    fsdp2 = make_plan(
        build_config(cfg.model_dump(mode="json"), ["parallelism.strategy=fsdp2"]),
        probe(env={}, query_output=""),
        model=model,
    )
    assert any(r.startswith("rollout weights: fsdp2 gathers every weight") for r in fsdp2.reasons)
    assert fsdp2.strategy_options["shard_head"] is False
    # The rollouts are sized with the rest: the KV cache, logits and buffers on every rank, and under a sharding
    # strategy the weights gathered whole beside the rank's shard.
    from ladle.sizing import shape_from_config

    whole = shape_from_config(model).params * 4  # float32
    kv_and_logits = plan_estimate(cfg, plan, model).rollout
    assert kv_and_logits > 0 and 0 < plan.memory["rollouts"] < plan.memory["train"]
    # A full fine-tune's reference: the starting weights whole beside a replica, half of them on each of 2 ranks
    # beside a shard; none with LoRA (the adapters are switched off) or with beta 0.
    assert plan_estimate(full, full_plan, model).reference == whole // 2
    replica = build_config(full.model_dump(mode="json"), ["parallelism.strategy=ddp"])
    assert (
        plan_estimate(replica, make_plan(replica, probe(env={}, query_output=""), model=model), model).reference
        == whole
    )
    assert plan_estimate(cfg, plan, model).reference == 0
    # On a CPU the update runs beside what the host heap kept of the rollouts: their KV cache, logits and buffers,
    # not the merged copy (its matrices go back to the system)
    transient = kv_and_logits - adapted
    assert plan_estimate(cfg, plan, model).kept == transient
    for sharded in (zero3, fsdp2):
        estimate = plan_estimate(sharded_cfg(cfg, sharded.strategy), sharded, model)
        assert estimate.rollout - kv_and_logits == whole, sharded.strategy  # every weight, beside the rank's shard
        # and of the weights gathered for them: under FSDP2 the part the rank does not hold, under ZeRO-3, whose
        # update gathers each layer into fresh blocks again, about all of them
        held = estimate.kept - transient
        if sharded is fsdp2:
            assert held == whole - estimate.weights and 0.3 * whole < held < 0.7 * whole
        else:
            assert held == whole
        assert any("rollouts " in r for r in sharded.reasons if r.startswith("memory per rank"))


def test_prompt_data_is_checked_for_prompts_and_the_rewards_columns(tmp_path, tiny_model):
    from ladle.data.prepare import prepare
    from ladle.errors import LadleError

    data = tmp_path / "rows.jsonl"
    base = {"base": "ladle://tiny-llama", "data": {"path": str(data)}}
    cfg = build_config({**base, "training": {"objective": "grpo", "rl": {"rewards": ["exact_match"]}}}, [])
    data.write_text(json.dumps({"instruction": "Say hi", "output": "hi"}) + "\n")
    with pytest.raises(
        LadleError, match=r"training.objective = grpo needs rows with a `prompt`.*\['instruction', 'output'\]"
    ):
        prepare(cfg.data, tiny_model, str(tmp_path / "out"), objective="grpo")
    rows = [{"prompt": "2+2=", "answer": "4"}, {"prompt": [{"role": "user", "content": "3+3="}]}, {"prompt": ""}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows * 40))
    with pytest.raises(LadleError, match=r"rows are unusable|unusable") as caught:
        prepare(cfg.data, tiny_model, str(tmp_path / "out"), objective="grpo")
    assert "empty prompt" in str(caught.value)
    cfg = build_config(cfg.model_dump(mode="json"), ["data.max_bad_fraction=0.5"])
    with pytest.raises(
        LadleError, match=r"training.rl.rewards read the column\(s\) \['answer'\], which some prompt rows lack"
    ):
        prepare(cfg.data, tiny_model, str(tmp_path / "out2"), objective="grpo", reward_columns=["answer"])
    prepared = prepare(cfg.data, tiny_model, str(tmp_path / "out3"), objective="grpo", reward_columns=[])
    assert prepared.report.format == "prompt" and prepared.report.invalid_rows == 40
    assert prepared.train_rows + prepared.eval_rows == 80


def test_a_micro_batch_of_distinct_prompts_takes_the_shared_path_and_scores_the_same(trl_trainer):
    """Whether the prompts are shared comes from the config, not the rows (every rank must run as many forwards):
    rows whose prompts all differ still go through the shared path, and score as each with its own prompt."""
    rows = [{"ids": PROMPTS[i % len(PROMPTS)]} for i in range(len(PROMPTS))]
    completions = COMPLETIONS[: len(rows)]
    assert len(grpo.distinct_prompts(rows)[0]) == len(rows)
    model = trl_trainer.model
    with torch.no_grad():
        shared, mask = grpo.completion_logps(model, rows, completions, 0, "cpu", TEMPERATURE, True)
        alone, same_mask = grpo.completion_logps(model, rows, completions, 0, "cpu", TEMPERATURE, False)
        packed, packed_mask = grpo.completion_logps(model, rows, completions, 0, "cpu", TEMPERATURE, True, True)
    assert torch.equal(mask, same_mask) and torch.equal(mask, packed_mask)
    torch.testing.assert_close(shared * mask, alone * mask, rtol=0, atol=1e-5)
    torch.testing.assert_close(packed * mask, alone * mask, rtol=0, atol=1e-5)
    assert model.config._attn_implementation == "sdpa"  # the packed forward's attention was for it alone


def test_merged_adapters_sample_what_the_adapters_compute_and_leave_the_model_as_it_was():
    """For the rollouts, each LoRA layer computes with its weight and adapter summed into one matrix: the same
    logits (float32 rounding apart) from one product a layer instead of three, no weight written, and after the
    context every layer is peft's again, giving the very same logits and gradients as before it."""
    model = tiny_lora_model().eval()
    ids = torch.tensor([PROMPTS[0] + COMPLETIONS[0]])
    before = model(input_ids=ids).logits.detach()
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad(), grpo.merged_adapters(model) as merged:
        assert merged == 2 * 7  # q, k, v, o, gate, up, down in each of 2 layers
        inside = model(input_ids=ids).logits
        assert all(
            "forward" in vars(m) for m in model.modules() if type(m).__name__ == "Linear" and hasattr(m, "lora_A")
        )
    torch.testing.assert_close(inside, before, rtol=0, atol=1e-5)
    assert not any("forward" in vars(m) for m in model.modules())  # peft's forward back on every layer
    assert all(torch.equal(p, base[n]) for n, p in model.named_parameters())  # nothing written
    after = model(input_ids=ids)
    assert torch.equal(after.logits.detach(), before)
    after.logits.sum().backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if "lora_" in n)  # the adapters still learn
    with model.disable_adapter(), grpo.merged_adapters(model) as merged:
        assert merged == 0  # disabled adapters: nothing to merge, peft's own forward


def test_a_run_that_forgets_the_probe_ends_with_the_adapter_of_its_last_check_within_it(tmp_path):
    """A probe the tiny model answers wholly at the start (its own greedy answers to five questions), a step size
    that makes it forget: the probe's checks during training are in the report, the first that finds it more than
    promote.max_probe_drop down ends the run, and the adapter saved is the last check's within bounds (scored
    again from the saved files, as the evaluation stage scores it)."""
    from ladle.config import EvalConfig
    from ladle.lifecycle.evaluate import probe_score
    from ladle.lifecycle.merge import merge_adapter
    from ladle.train.run import launch
    from tests.helpers import offline_greedy

    questions = ["red blue green", "one two three", "the colour of", "x y z", "count to four"]
    probe = tmp_path / "probe.jsonl"
    plain = grpo_spec("ddp", tmp_path, processes=1)
    answers = [offline_greedy(plain.base_dir, [{"role": "user", "content": q}], 8) for q in questions]
    probe.write_text(
        "".join(
            json.dumps({"question": q, "answers": [a.strip()]}) + "\n" for q, a in zip(questions, answers, strict=True)
        )
    )
    watched = (f"eval.probe={probe}", "eval.probe_max_new_tokens=8", "promote.max_probe_drop=0.1")
    spec = grpo_spec("ddp", tmp_path, *watched, "training.rl.probe_every=1", "training.lr=5e-2", processes=1)
    result = launch(spec)
    trend = result.rl["probe_trend"]
    assert trend[0] == [0, 1.0], trend
    assert trend[-1][1] < 0.9 and all(score >= 0.9 for _, score in trend[:-1]), trend
    kept_step, kept_score = int(trend[-2][0]), trend[-2][1]
    assert result.steps == trend[-1][0] < 4
    assert f"the adapter of step {kept_step} (probe {kept_score})" in result.rl["probe_guard"]
    merge_adapter(plain.base_dir, storage.local_path(result.adapter_url), tmp_path / "merged")
    again, _ = probe_score(tmp_path / "merged", EvalConfig(probe=str(probe), probe_max_new_tokens=8))
    assert again == kept_score
