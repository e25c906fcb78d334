"""Episodes rolled out the way ladle serves: the model's tool calls read by the server's parser, the results put
back through the chat template after the model's own tokens (never decoded and encoded again), the mask on the
model's tokens only, and every way an episode ends."""

from __future__ import annotations

import json

import pytest
import torch

from ladle.agents import environments, episodes
from ladle.agents.tool_host import ToolHost
from ladle.serve.rows import Job
from tests.agents.test_tool_host import FAULTY
from tests.templates import HERMES_TEMPLATE


@pytest.fixture(scope="module")
def hermes_tiny(tiny_model, tmp_path_factory):
    """The tiny model with a template that teaches Hermes tool calls (laid over it as a recipe's chat_template
    is), its tokenizer and an engine over it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ladle.assets.templates import with_template
    from ladle.serve.engine import Engine

    template = tmp_path_factory.mktemp("hermes") / "hermes.jinja"
    template.write_text(HERMES_TEMPLATE)
    folder = with_template(tiny_model, str(template))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return tokenizer, Engine(model, tokenizer, "cpu", 8, thread=False)


class Scripted:
    """An engine double for a model that calls tools: each episode's turns are given texts (the tiny model never
    writes a tool call). Episode k's turn t is told apart by its seed (``seed(k, t) = 100 k + t``)."""

    def __init__(self, tokenizer, scripts: list[list[str]]) -> None:
        self.tokenizer, self.scripts, self.asked = tokenizer, scripts, []

    def run(self, jobs: list[Job]) -> None:
        for job in jobs:
            k, turn = divmod(job.seed, 100)
            self.asked.append(list(job.ids))
            tokens = self.tokenizer(self.scripts[k][turn], add_special_tokens=False)["input_ids"]
            if len(tokens) > job.max_new_tokens:
                job.tokens, job.finish = tokens[: job.max_new_tokens], "length"
                job.chosen = list(job.tokens)
            else:
                job.tokens, job.finish, job.stop_token = tokens, "stop", self.tokenizer.eos_token_id
                job.chosen = [*tokens, job.stop_token]
            job.sampled = [-0.25] * len(job.chosen)


def call_text(name: str, arguments: dict) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def settings(**changes) -> episodes.Settings:
    return episodes.Settings(**{"max_turns": 3, "max_completion_tokens": 256, "max_tool_result_tokens": 64, **changes})


def seed(k: int, turn: int) -> int:
    return 100 * k + turn


def test_a_multi_turn_episode_trains_the_models_tokens_and_the_templates_tool_blocks_as_served(hermes_tiny):
    tokenizer, _ = hermes_tiny
    env = environments.load("calculator", {})
    tools = list(env.tools)
    question = [{"role": "user", "content": "What is 12 * (3 + 4)?"}]
    rows = [{"prompt": question, "columns": {"answer": "84"}}]
    script = [[call_text("calculate", {"expression": "12 * (3 + 4)"}), "It is 84."]]
    engine = Scripted(tokenizer, script)
    with ToolHost(env, 5.0, 64) as host:
        (e,), _ = episodes.run(engine, tokenizer, host, env, rows, settings(), seed)
    assert (e.ended, e.turns, e.calls) == ("answer", 2, 1)
    # The whole sequence is the template's own rendering of the conversation the server would hold: the model's
    # call as it wrote it, the result as the template puts it, the answer; the model's tokens are the ones the
    # engine sampled (EOS included) and nothing else is trained.
    conversation = question + [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "calculate", "arguments": {"expression": "12 * (3 + 4)"}}}],
        },
        {"role": "tool", "name": "calculate", "content": "84"},
        {"role": "assistant", "content": "It is 84."},
    ]
    rendered = tokenizer.apply_chat_template(conversation, tools=tools, tokenize=False)
    expected = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    whole = e.prompt_ids + e.ids
    assert whole == expected[: len(whole)] and tokenizer.decode(expected[len(whole) :]) == "\n"
    first = tokenizer(script[0][0], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    answer = tokenizer("It is 84.", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    block = len(e.ids) - len(first) - len(answer)
    assert e.ids[: len(first)] == first and e.ids[-len(answer) :] == answer
    assert e.mask == [1] * len(first) + [0] * block + [1] * len(answer)
    assert e.logps == [-0.25] * len(first) + [0.0] * block + [-0.25] * len(answer)
    assert tokenizer.decode(e.ids[len(first) : len(first) + block]).startswith("\n<|user|>\n<tool_response>84<")
    # The second turn was asked on exactly the tokens so far, the tools in its prompt.
    assert engine.asked == [e.prompt_ids, e.prompt_ids + e.ids[: len(first) + block]]
    assert '"name": "calculate"' in tokenizer.decode(e.prompt_ids)
    record = e.record()
    assert record["messages"][0]["tool_calls"][0]["function"] == {
        "name": "calculate",
        "arguments": json.dumps({"expression": "12 * (3 + 4)"}),
    }
    assert record["messages"][1] == {"role": "tool", "name": "calculate", "content": "84"}
    assert (record["model_tokens"], record["tool_tokens"]) == (len(first) + len(answer), block)


def test_every_way_an_episode_ends_is_marked_and_ends_only_that_episode(hermes_tiny, tmp_path):
    tokenizer, _ = hermes_tiny
    path = tmp_path / "faulty.py"
    path.write_text(FAULTY)
    entry = f"{path}:Faulty"
    env = environments.load(entry, environments.bundle(entry))
    scripts = [
        [call_text("bump", {}), call_text("bump", {}), call_text("bump", {})],  # still calling at its last turn
        [call_text("boom", {})],
        [call_text("hang", {})],
        [call_text("huge", {})],
        [call_text("nowhere", {})],
        [call_text("bump", {"by": 2})],
        ["word " * 400],  # cut at max_completion_tokens
        ["<tool_call>{not json</tool_call>"],  # not a call in the format: the model's answer, as the server reads it
        [call_text("chatty", {}) * 3],  # three results: their block is over max_tool_result_tokens
        [call_text("bump", {}), "done"],
    ]
    rows = [{"prompt": "count", "columns": {"start": 1}} for _ in scripts]
    with ToolHost(env, 1.0, 64) as host:
        done, _ = episodes.run(Scripted(tokenizer, scripts), tokenizer, host, env, rows, settings(), seed)
    ended = [e.ended for e in done]
    assert ended == [
        "max_turns",
        "raised",
        "tool_timeout",
        "result_too_long",
        "unknown_tool",
        "bad_arguments",
        "length",
        "answer",
        "tool_result_too_long",
        "answer",
    ]
    assert done[0].calls == 2 and done[0].turns == 3  # the last turn's call was not run
    assert done[1].error == "boom({}): ValueError: the tool broke"
    assert "max_tool_result_tokens is 64" in done[8].error
    assert done[9].messages[1]["content"] == "2"  # reset(start=1) from the row's columns, then one bump
    for e in done:
        assert len(e.ids) == len(e.mask) == len(e.logps)
        assert e.model_tokens == sum(e.mask) and sum(e.logps) == pytest.approx(-0.25 * e.model_tokens)


def test_a_prompt_over_the_planned_length_with_its_tools_never_starts(hermes_tiny):
    tokenizer, _ = hermes_tiny
    env = environments.load("calculator", {})
    rows = [{"prompt": "2 + 3?", "columns": {}}, {"prompt": "What is two plus three? " * 40, "columns": {}}]
    engine = Scripted(tokenizer, [["5"], ["5"]])
    short = len(episodes.render_ids(tokenizer, [{"role": "user", "content": "2 + 3?"}], list(env.tools), True))
    with ToolHost(env, 5.0, 64) as host:
        done, _ = episodes.run(engine, tokenizer, host, env, rows, settings(max_prompt_tokens=short + 8), seed)
    assert [(e.ended, e.turns) for e in done] == [("answer", 1), ("prompt_too_long", 0)]
    assert f"data.seq_len is {short + 8}" in done[1].error and done[1].ids == []
    assert len(engine.asked) == 1  # the long one was never generated


def test_the_engines_sampled_ids_are_the_trained_ones(hermes_tiny):
    """On the real engine and model: an episode's tokens and log-probabilities are exactly what the engine drew
    for the same prompt and seed, with nothing decoded and encoded again in between."""
    tokenizer, engine = hermes_tiny
    env = environments.load("calculator", {})
    rows = [
        {"prompt": [{"role": "user", "content": f"Translate the colours to numbers.\nred blue {c}"}], "columns": {}}
        for c in ("green", "white", "black", "red")
    ]
    with ToolHost(env, 5.0, 64) as host:
        done, seconds = episodes.run(engine, tokenizer, host, env, rows, settings(max_completion_tokens=12), seed)
    assert seconds > 0
    for k, e in enumerate(done):
        job = Job(
            ids=list(e.prompt_ids), max_new_tokens=12, temperature=1.0, seed=seed(k, 0), sampled=[], writes_text=False
        )
        engine.run([job])
        assert e.ended in ("answer", "length") and e.turns == 1
        assert e.ids == job.chosen and e.mask == [1] * len(job.chosen)
        # The same draw alone instead of in a batch of four: float32 sums in another order, the same tokens.
        assert e.logps == pytest.approx(job.sampled, abs=1e-4)
    # Greedy (held-out) episodes keep the EOS that ended a turn, as the rollouts do.
    with ToolHost(env, 5.0, 64) as host:
        greedy, _ = episodes.run(engine, tokenizer, host, env, rows[:1], settings(max_completion_tokens=12), None)
    job = Job(ids=list(greedy[0].prompt_ids), max_new_tokens=12)
    engine.run([job])
    assert greedy[0].ids == job.tokens + ([job.stop_token] if job.stop_token is not None else [])


def test_a_template_that_cannot_carry_results_after_the_models_tokens_is_refused(hermes_tiny):
    tokenizer, _ = hermes_tiny
    import copy

    other = copy.copy(tokenizer)
    other.chat_template = HERMES_TEMPLATE.replace(
        "{%- for m in messages %}", "{%- for m in messages %}{% if m.role == 'tool' %}[{{ loop.length }}]{% endif %}"
    ).replace("{{ bos_token }}", "{{ bos_token }}{{ messages | length }}")
    with pytest.raises(episodes.TemplateError, match="does not start with its rendering"):
        episodes.suffix_ids(other, [], [{"role": "tool", "name": "f", "content": "1"}])
    with pytest.raises(Exception, match="does not render tools"):
        other.chat_template = "{{ messages }}"
        episodes.tool_format(other)


def test_a_taught_model_calls_the_tool_reads_its_result_and_answers_through_the_real_engine(tool_caller):
    """The real engine over a model that learned to call: the call parsed by the server's parser, run in the
    host, its result read back in the second turn, the answer scored; every model token the engine's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ladle.serve.engine import Engine

    tokenizer = AutoTokenizer.from_pretrained(tool_caller)
    engine = Engine(
        AutoModelForCausalLM.from_pretrained(tool_caller, dtype=torch.float32).eval(), tokenizer, "cpu", 8, thread=False
    )
    env = environments.load("calculator", {})
    rows = [{"prompt": [{"role": "user", "content": "What is 2 + 3?"}], "columns": {}}] * 4
    with ToolHost(env, 5.0, 64) as host:
        done, _ = episodes.run(engine, tokenizer, host, env, rows, settings(max_completion_tokens=80), None)
    for e in done:
        assert (e.ended, e.turns, e.calls) == ("answer", 2, 1)
        assert e.messages[1] == {"role": "tool", "name": "calculate", "content": "5"}
        assert e.messages[2] == {"role": "assistant", "content": "5"}


GUESS = '''
class Guess:
    """A gym-style game: guess the number; each answer is told higher or lower, the right one ends it."""

    def reset(self, target: int):
        self.target, self.tries = int(target), 0
        return "Guess my number, 1 to 10."

    def step(self, action: str):
        self.tries += 1
        guess = int(action.strip()) if action.strip().isdigit() else None
        if guess == self.target:
            return {"observation": "right", "reward": 1.0 / self.tries, "done": True}
        if guess is None:
            raise ValueError(f"not a number: {action!r}")
        return ("higher" if guess < self.target else "lower"), 0.0, False
'''


def test_a_gym_style_environment_gets_each_turns_text_and_answers_as_a_user_turn(hermes_tiny, tmp_path):
    from ladle import rewards as reward_fns
    from ladle.config.training import RewardConfig

    tokenizer, _ = hermes_tiny
    path = tmp_path / "guess.py"
    path.write_text(GUESS)
    entry = f"{path}:Guess"
    env = environments.load(entry, environments.bundle(entry))
    assert env.steps and env.tools == ()
    scripts = [["5", "8", "7"], ["3", "2", "1"], ["hm"], ["9"]]
    rows = [{"prompt": "play", "columns": {"target": t}} for t in (7, 9, 1, 9)]
    with ToolHost(env, 5.0, 64) as host:
        done, _ = episodes.run(Scripted(tokenizer, scripts), tokenizer, host, env, rows, settings(), seed)
    assert [(e.ended, e.turns, e.env_reward) for e in done] == [
        ("done", 3, pytest.approx(1 / 3)),
        ("max_turns", 3, 0.0),
        ("raised", 1, None),
        ("done", 1, 1.0),
    ]
    e = done[0]
    assert e.prompt[-1]["content"] == "play\n\nGuess my number, 1 to 10."  # reset's text joins the last user turn
    assert [m["content"] for m in e.messages] == ["5", "higher", "8", "lower", "7", "right"]
    first = tokenizer("5", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    block = episodes.suffix_ids(tokenizer, [], [{"role": "user", "content": "higher"}])
    assert e.ids[: len(first) + len(block)] == first + block and tokenizer.decode(block).startswith(
        "\n<|user|>\nhigher"
    )
    assert e.mask[: len(first) + len(block)] == [1] * len(first) + [0] * len(block)
    assert "not a number: 'hm'" in done[2].error
    loaded = reward_fns.load_all([RewardConfig(fn="env_reward")], {})
    records = [x.record() for x in done]
    table = reward_fns.table(loaded, tokenizer, rows, [x.ids for x in done], episodes=records)
    assert table[:, 0].tolist()[:2] == [pytest.approx(1 / 3), 0.0] and torch.isnan(table[2, 0])


def test_a_turn_resumed_from_the_kept_cache_draws_what_a_whole_prefill_draws(tool_caller):
    """The second turn starts from the engine's keys and values of the first (only the last token and the tool
    block prefilled); the same draw from a fresh prefill of the whole conversation gives the same tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ladle.serve.engine import Engine

    tokenizer = AutoTokenizer.from_pretrained(tool_caller)
    model = AutoModelForCausalLM.from_pretrained(tool_caller, dtype=torch.float32).eval()
    engine = Engine(model, tokenizer, "cpu", 8, thread=False)
    env = environments.load("calculator", {})
    rows = [{"prompt": [{"role": "user", "content": q}], "columns": {}} for q in ("What is 2 + 3?", "2 plus 3?")] * 2
    with ToolHost(env, 5.0, 64) as host:
        done, _ = episodes.run(engine, tokenizer, host, env, rows, settings(max_completion_tokens=80), seed)
    second = [e for e in done if e.turns == 2]
    assert second, [e.ended for e in done]
    for k, e in enumerate(done):
        if e.turns < 2:
            continue
        start = e.mask.index(0) + e.mask[e.mask.index(0) :].index(1)  # the second turn's first token
        job = Job(
            ids=e.prompt_ids + e.ids[:start],
            max_new_tokens=80,
            temperature=1.0,
            seed=seed(k, 1),
            sampled=[],
            writes_text=False,
        )
        engine.run([job])
        assert e.ids[start:] == job.chosen
        assert e.logps[start:] == pytest.approx(job.sampled, abs=1e-4)
