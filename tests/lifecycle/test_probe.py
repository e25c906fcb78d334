"""The general-ability probe (eval.probe), its promotion guard (promote.max_probe_drop) and data.system_prompt."""

from __future__ import annotations

import json

import pytest

from ladle.errors import LadleError


def test_the_shipped_probe_loads():
    from ladle.lifecycle.evaluate import load_probe

    questions = load_probe("ladle://general-probe")
    assert len(questions) == 32
    assert {"question": "What is the capital of France?", "answers": ["Paris"]} in questions


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "line 1 is not JSON"),
        ('{"question": "Why?"}', "line 1 must be"),
        ('{"question": "Why?", "answers": []}', "line 1 must be"),
        ('{"question": "", "answers": ["x"]}', "line 1 must be"),
        ('{"question": "Why?", "answers": [3]}', "line 1 must be"),
        ("[1, 2]", "line 1 must be"),
    ],
)
def test_a_bad_probe_row_names_the_field_and_the_line(tmp_path, line, message):
    from ladle.lifecycle.evaluate import load_probe

    path = tmp_path / "probe.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(LadleError) as err:
        load_probe(str(path))
    assert str(err.value).startswith(f"eval.probe = '{path}': {message}")


def test_a_missing_or_empty_probe_and_an_unknown_builtin(tmp_path):
    from ladle.lifecycle.evaluate import load_probe

    with pytest.raises(LadleError, match="no such file"):
        load_probe(str(tmp_path / "none.jsonl"))
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(LadleError, match="holds no question"):
        load_probe(str(tmp_path / "empty.jsonl"))
    with pytest.raises(LadleError, match="the one built-in probe is ladle://general-probe"):
        load_probe("ladle://trivia")


@pytest.mark.parametrize(
    ("answer", "accepted", "right"),
    [
        ("The capital of France is Paris.", ["Paris"], True),
        ("paris", ["Paris"], True),
        ("Parisian food", ["Paris"], False),
        ("The square root of 9 is approximately 3.09.", ["3", "three"], False),
        ("It is 3.", ["3"], True),
        ("Plants take in carbon dioxide.", ["carbon dioxide", "CO2"], True),
        ("", ["x"], False),
    ],
)
def test_an_answer_is_right_when_it_holds_an_accepted_word(answer, accepted, right):
    from ladle.lifecycle.evaluate import answered

    assert answered(answer, accepted) is right


def decision(promoted: bool = True):
    from ladle.lifecycle.gate import decide

    return decide("exact_match", True, 0.4 if promoted else 0.0, 0.0, "base model", 0.0)


def test_the_probe_guard_holds_back_a_model_that_lost_general_ability():
    from ladle.lifecycle.gate import guard_probe

    held = guard_probe(decision(), 0.31, 0.69, 0.1)
    assert not held.promoted
    assert held.reason.startswith("not promoted: probe 0.31 vs base model 0.69 fell by 0.38")
    assert "more than promote.max_probe_drop 0.1" in held.reason and "the task gate alone said: promoted" in held.reason
    assert (held.probe, held.probe_reference, held.max_probe_drop) == (0.31, 0.69, 0.1)

    kept = guard_probe(decision(), 0.62, 0.69, 0.1)
    assert kept.promoted and kept.reason.endswith("; probe 0.62 vs base model 0.69 (may fall by 0.1)")
    assert guard_probe(decision(), 0.9, 0.69, 0.0).promoted  # a better probe always passes


def test_the_probe_guard_without_a_limit_or_a_score():
    from ladle.lifecycle.gate import guard_probe

    reported = guard_probe(decision(), 0.1, 0.9, None)
    assert reported.promoted and reported.probe == 0.1  # reported, not gated
    assert not guard_probe(decision(promoted=False), 0.9, 0.1, 0.1).promoted  # the task gate still decides
    missing = guard_probe(decision(), None, 0.9, 0.1)
    assert not missing.promoted and "the probe was not scored for the new model" in missing.reason


def test_a_probe_gate_without_a_probe_is_a_config_error():
    from ladle.config import build_config
    from ladle.errors import ConfigError

    with pytest.raises(ConfigError, match="promote.max_probe_drop = 0.1: there is no probe to gate on"):
        build_config({"base": "ladle://tiny-llama", "data": {"path": "x"}, "promote": {"max_probe_drop": 0.1}}, [])


def test_the_system_prompt_goes_first_in_conversations_without_one(tmp_path, tiny_model):
    from ladle.config import DataConfig
    from ladle.data.prepare import prepare
    from ladle.lifecycle.evaluate import load_samples

    rows = [{"instruction": f"Say {i}.", "input": "", "output": str(i)} for i in range(40)]
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    plain = prepare(DataConfig(path=str(data), eval_ratio=0.2), tiny_model, str(tmp_path / "a"))
    prompted = prepare(
        DataConfig(path=str(data), eval_ratio=0.2, system_prompt="Count."), tiny_model, str(tmp_path / "b")
    )
    assert prompted.fingerprint != plain.fingerprint
    samples = load_samples(prompted, 100)
    assert samples and all(m[0] == {"role": "system", "content": "Count."} for m in samples)
    assert all(m[0]["role"] == "user" for m in load_samples(plain, 100))
    assert prompted.report.tokens_total > plain.report.tokens_total


def test_the_rehearsal_data_mixes_the_tasks_with_the_models_own_answers_and_holds_none_of_the_probe():
    from ladle.assets import demo_heldout_file, demo_replay_file
    from ladle.lifecycle.evaluate import load_probe

    train = [json.loads(line) for line in demo_replay_file().open()]
    held = [json.loads(line) for line in demo_heldout_file().open()]
    replay = [r for r in train if r["input"] == ""]
    assert len(train) == 1200 + 2 * 106 and len(replay) == 2 * 106 and len(held) == 120
    assert {r["instruction"] for r in replay}.isdisjoint(q["question"] for q in load_probe("ladle://general-probe"))
    assert {(r["instruction"], r["input"]) for r in held}.isdisjoint((r["instruction"], r["input"]) for r in train)
    assert max(i for i, r in enumerate(train) if r["input"] == "") > len(train) * 0.9  # spread to the end
