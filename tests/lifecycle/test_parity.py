"""The parity gate (``ladle.lifecycle.parity``) against a real server: the base served and scored from its saved
weights agrees within 1e-4; the same server held to an adapter's log-probabilities (weights that are not the
served ones) fails naming the answer token that differs most; a probe tokenized with a doubled BOS (what a
template or tokenizer mismatch looks like) fails naming the first prompt token that differs; and a failed check
holds back a promotion the gate would otherwise make."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from ladle.lifecycle import gate, parity
from ladle.serve.backends import TransformersBackend
from ladle.serve.server import Settings, create_app
from tests.serve.adapter_kit import make_adapter
from tests.serve.running import Running

CONVERSATIONS = [
    [
        {"role": "user", "content": f"{row['instruction']}\n{row['input']}"},
        {"role": "assistant", "content": row["output"]},
    ]
    for row in (
        {"instruction": "Translate the colours to numbers.", "input": "blue red blue", "output": "1 0 1"},
        {"instruction": "What is the last colour?", "input": "red red green", "output": "green"},
        {"instruction": "Repeat the list.", "input": "orange white", "output": "orange white"},
    )
]


@pytest.fixture(scope="module")
def served(tiny_model, tokenizer):
    running = Running(create_app(TransformersBackend(str(tiny_model), max_batch=4), Settings("tiny")))
    rows = parity.probe(tokenizer, CONVERSATIONS, SimpleNamespace(train_on="response", seq_len=256))
    yield running.url, rows
    running.stop()


def test_the_served_base_equals_its_saved_weights(served, tiny_model, tokenizer):
    url, rows = served
    assert len(rows) == parity.PROBE_ROWS and all(row.answer for row in rows)
    found = parity.check(url, "tiny", rows, parity.saved_logps(tiny_model, rows), "saved weights", 1e-4, tokenizer)
    assert found.ok is True and found.max_abs < 1e-4 and found.answer_tokens == sum(len(r.answer) for r in rows)


def test_other_weights_fail_naming_the_token_that_differs_most(served, tiny_model, tokenizer, tmp_path):
    url, rows = served
    adapter = make_adapter(tiny_model, tmp_path / "adapter", 4, ["q_proj", "v_proj"], 7)
    other = parity.saved_logps(tiny_model, rows, adapter)
    found = parity.check(url, "tiny", rows, other, "training process", 1e-4, tokenizer)
    assert found.ok is False and found.max_abs > 1e-4
    assert found.where.startswith("weights: held-out conversation") and "answer token" in found.where


def test_multi_turn_conversations_train_on_all_and_grpo_prompts_pass_against_the_served_model(
    served, tiny_model, tokenizer
):
    """The template check asks the server for the conversation up to its last answer, so it must hold training's
    tokens up to that answer's first token: with earlier turns, with every token trained (train_on: all), and for
    GRPO's held-out prompts (their ids as prepared). Before, the check cut at the first trained token and failed
    every such run."""
    from ladle.data.prompts import render

    url, _ = served
    first, second = CONVERSATIONS[0], CONVERSATIONS[1]
    multi = [*first, *second]  # user, assistant, user, assistant
    for train_on, conversations in (("response", [multi, multi]), ("all", CONVERSATIONS), ("all", [multi, multi])):
        rows = parity.probe(tokenizer, conversations, SimpleNamespace(train_on=train_on, seq_len=256))
        assert len(rows) == parity.PROBE_ROWS, train_on
        found = parity.check(url, "tiny", rows, parity.saved_logps(tiny_model, rows), "saved weights", 1e-4, tokenizer)
        assert found.ok is True, (train_on, found.where)
        if train_on == "all":  # every token but the first carried the loss, and every one is compared
            assert all(row.answer == list(range(1, len(row.ids))) for row in rows)
    prompts = [{"ids": render(tokenizer, c[:-1]), "prompt": c[:-1]} for c in CONVERSATIONS] + [
        {"ids": [1, 2, 3], "prompt": "a plain-text prompt: no template to compare"}
    ]
    rows = parity.prompt_probe(prompts)
    assert len(rows) == parity.PROBE_ROWS
    found = parity.check(url, "tiny", rows, parity.saved_logps(tiny_model, rows), "saved weights", 1e-4, tokenizer)
    assert found.ok is True and found.answer_tokens == sum(len(r.ids) - 1 for r in rows), found


def test_a_doubled_bos_fails_as_a_template_mismatch(served, tiny_model, tokenizer):
    url, rows = served
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else 1
    doubled = [row.model_copy(update={"ids": [bos, *row.ids], "prompt_tokens": row.prompt_tokens + 1}) for row in rows]
    found = parity.check(url, "tiny", doubled, [[0.0] * len(r.ids) for r in doubled], "t", 1e-4, tokenizer)
    assert found.ok is False and found.where.startswith("template: held-out conversation 0")
    assert f"training {bos} {tokenizer.decode([bos])!r}" in found.where  # the doubled token, by id and text


def test_a_parity_failure_holds_back_a_promotion():
    decision = gate.decide("exact_match", True, 0.9, 0.1, "base model", 0.0)
    assert decision.promoted
    held = gate.guard_parity(decision, "weights: token 3 differs")
    assert not held.promoted and "not the trained one (weights: token 3 differs)" in held.reason
    assert gate.guard_parity(decision, None) == decision
    assert json.loads(parity.Parity(ok=None, reference="-").model_dump_json())["ok"] is None


def test_a_bf16_autocast_run_is_compared_in_float32_and_equals_its_saved_adapter(tiny_model, tokenizer, tmp_path):
    """A 16-bit run under DDP computes under accelerate's autocast around float32 master weights. Its parity forward
    sets autocast aside: the weights as they are (what the merge writes and the server runs), float32 against
    float32 within 1e-4, where autocast's rounding alone differs by about 3e-3 per token on SmolLM2 (which held the
    shipped real-model recipe's promotion back)."""
    from ladle.config import build_config
    from ladle.train.run import launch
    from tests.helpers import train_spec

    cfg = build_config(
        {
            "base": "ladle://tiny-llama",
            "data": {"path": "ladle://demo-alpaca", "seq_len": 64},
            "training": {"max_steps": 2, "dtype": "bfloat16", "lr": 1e-2, "checkpoint_every": 0},
        },
        [],
    )
    spec = train_spec(cfg, tmp_path)
    rows = parity.probe(tokenizer, CONVERSATIONS, cfg.data)
    spec = spec.model_copy(update={"parity_probe": [row.model_dump() for row in rows]})
    assert spec.plan.strategy == "ddp" and spec.plan.dtype == "bfloat16"
    result = launch(spec)
    saved = parity.saved_logps(tiny_model, rows, result.adapter_url)
    worst = max(abs(a - b) for r, s in zip(result.parity_logps, saved, strict=True) for a, b in zip(r, s, strict=True))
    assert worst < 1e-4, worst
    assert result.parity_dtype == "float32"
