"""GRPO for an agent (``training.rl.environment``) in a real 2-process run: episodes of the taught tiny model
(``tests/agents/tool_caller.py``) rolled out by each rank's engine on the live LoRA weights, the calculator run in
each rank's tool host, the loss on the model's tokens only, the rewards given the whole episode, and the episodes
logged for a person to read."""

from __future__ import annotations

import json

import pytest

from ladle import rewards as reward_fns
from ladle.config import build_config
from ladle.errors import ConfigError
from ladle.platform import storage

SCORE = (
    "def score(completions, episodes, answer, **kwargs):\n"
    "    out = []\n"
    "    for messages, episode, expected in zip(completions, episodes, answer):\n"
    "        said = messages[-1]['content'].strip() if messages[-1]['role'] == 'assistant' else ''\n"
    "        out.append(0.5 * (episode['calls'] > 0) + (said == expected))\n"
    "    return out\n"
)


def prompts(path, questions):
    rows = [{"prompt": [{"role": "user", "content": q}], "answer": "5"} for q in questions]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def agent_config(root, base, *overrides):
    (root / "score.py").write_text(SCORE)
    questions = ["What is 2 + 3?", "Add 2 and 3.", "2 plus 3?", "Sum 2 and 3."]
    return build_config(
        {
            "base": str(base),
            "data": {
                "path": prompts(root / "train.jsonl", questions * 4),
                "eval_path": prompts(root / "eval.jsonl", questions[:2]),
                "seq_len": 64,
            },
            "parallelism": {"strategy": "ddp", "cpu_processes": 2},
            "training": {
                "objective": "grpo",
                "max_steps": 2,
                "lr": 1e-3,
                "scheduler": "constant",
                "micro_batch_size": 4,
                "global_batch_size": 8,
                "lora": {"target_modules": "all-linear"},
                "rl": {
                    "num_generations": 4,
                    "max_completion_tokens": 80,
                    "environment": "calculator",
                    "episode": {"max_turns": 3},
                    "rewards": [str(root / "score.py") + ":score"],
                },
            },
        },
        list(overrides),
    )


@pytest.mark.parametrize("environment", ["calculator", "calculator-agent"])
def test_an_agent_learns_from_whole_episodes_on_two_processes(tool_caller, tmp_path, environment):
    """The calculator as ladle's environment in each rank's tool host, and as an OpenAI SDK agent program
    (``ladle.agents.builtin.calculator_agent``) playing against each rank's endpoint of the live policy: the same
    training either way."""
    from ladle.agents import environments
    from ladle.train.run import launch
    from tests.helpers import train_spec

    cfg = agent_config(tmp_path, tool_caller, f"training.rl.environment={environment}")
    spec = train_spec(cfg, tmp_path, "agent")
    files = {**reward_fns.bundle(cfg.training.rl.rewards), **environments.bundle(cfg.training.rl.environment)}
    spec = spec.model_copy(update={"reward_files": files})
    result = launch(spec)
    assert result.world_size == 2 and result.steps == 2
    # The trainer's forward over whole episodes (tool blocks included as context) scored the model's tokens as the
    # engine sampled them: the sampled ids are the trained ids.
    assert result.rl["rollout_logprob_gap_max"] < 1e-4
    assert result.kernels["episode_logs"] == "heldout-before.jsonl, last-step.jsonl, heldout-after.jsonl"
    step = [
        json.loads(line)
        for line in storage.read_bytes(storage.join(spec.run_url, "episodes", "last-step.jsonl")).decode().splitlines()
    ]
    assert len(step) == 4  # rank 0's share of the step's 8 episodes
    called = [r for r in step if r["calls"]]
    assert called, step
    for record in called:
        call = record["messages"][0]["tool_calls"][0]["function"]
        assert call["name"] == "calculate"
        assert record["messages"][1]["role"] == "tool"
        assert record["reward"] is not None and record["model_tokens"] > 0 and record["tool_tokens"] > 0
    held = [
        json.loads(line)
        for line in storage.read_bytes(storage.join(spec.run_url, "episodes", "heldout-after.jsonl"))
        .decode()
        .splitlines()
    ]
    assert len(held) == 2  # both ranks' held-out episodes, gathered
    assert all(r["ended"] == "answer" and r["calls"] == 1 and r["reward"] == 1.5 for r in held), held
    assert result.rl["eval_reward_after"] == pytest.approx(1.5)


def test_an_agent_is_refused_before_training_where_it_cannot_run(tmp_path, tiny_model, tool_caller):
    from ladle.plan.inputs import check_environment

    with pytest.raises(ConfigError, match="training.rl.environment = 'calculator' with training.objective = sft"):
        build_config(
            {
                "base": "ladle://tiny-llama",
                "data": {"path": "x.jsonl"},
                "training": {"rl": {"environment": "calculator"}},
            },
            [],
        )
    from ladle.errors import LadleError

    with pytest.raises(LadleError, match="does not render tools.*Set chat_template to one that does"):
        check_environment("calculator", tiny_model)  # the tiny model's own template renders no tools
    with pytest.raises(LadleError, match="training.rl.environment = 'nope.py:E': no such file"):
        check_environment("nope.py:E", tiny_model)
    # A gym-style environment's turns are text: any chat template will do.
    game = tmp_path / "game.py"
    game.write_text("class Game:\n    def step(self, action):\n        return 'ok'\n")
    assert check_environment(f"{game}:Game", tiny_model) == {str(game): game.read_text()}
    # A seq_len that cannot hold the tools' descriptions: every episode's prompt would be over it.
    with pytest.raises(LadleError, match=r"data.seq_len = 16 cannot hold a prompt of .*its tools' descriptions take"):
        check_environment("calculator", tool_caller, seq_len=16)
    assert check_environment("calculator", tool_caller, seq_len=512) == {}  # a built-in: no file travels
    # An agent program's: its signature, before anything trains (its tools are checked when it sends them).
    agent = tmp_path / "agent.py"
    agent.write_text("def play(client, model, messages, **columns):\n    return 1\n\ndef bad(client):\n    pass\n")
    assert check_environment(f"{agent}:play", tiny_model) == {str(agent): agent.read_text()}
    with pytest.raises(LadleError, match=r"bad\(client\) cannot be called as program\(client, model, messages"):
        check_environment(f"{agent}:bad", tiny_model)


def test_the_planner_sizes_an_agents_whole_episodes(tmp_path, tool_caller):
    """An episode is max_turns turns and the tool blocks between them: the rollouts' KV cache and the update's rows
    are sized at that length, not one turn's."""
    from ladle.machine.topology import probe
    from ladle.plan.memory import rollout_parts
    from ladle.plan.planner import make_plan

    cfg = agent_config(tmp_path, tool_caller)
    rl = cfg.training.rl
    assert rl.completion_budget == 3 * 80 + 2 * 256  # max_turns x max_completion_tokens + the blocks between
    single = build_config(cfg.model_dump(mode="json"), ["training.rl.environment=null"])
    assert single.training.rl.completion_budget == 80
    model = json.loads((tool_caller / "config.json").read_text())
    topo = probe(env={}, query_output="")
    plan = make_plan(cfg, topo, model=model)
    said = next(r for r in plan.reasons if r.startswith("rollout memory per rank"))
    assert f"{cfg.data.seq_len + rl.completion_budget} tokens x 2 layers" in said, said
    kv = {c.training.rl.completion_budget: rollout_parts(c, model, plan, 4)["kv"] for c in (cfg, single)}
    assert kv[rl.completion_budget] / kv[80] == pytest.approx((64 + 752) / (64 + 80))
