"""Preference pairs as training data: the shapes people have, rendered through the chat template into one row per
pair, completions alone labelled, the truncation rules counted, bad pairs dropped and counted like any bad row, and
the objective checked against the rows."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from ladle.config import DataConfig
from ladle.data.formats import RowError
from ladle.data.packing import IGNORE, read_rows
from ladle.data.preference import Pair, pair_row, parse_pair, tokenize_pairs
from ladle.data.prepare import fingerprint, prepare
from ladle.errors import LadleError
from ladle.platform import storage

SKY = [{"role": "user", "content": "Colour of the sky?"}]


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.mark.parametrize(
    "row",
    [
        {"prompt": "Colour of the sky?", "chosen": "blue", "rejected": "green"},
        {"prompt": SKY, "chosen": [{"role": "assistant", "content": "blue"}], "rejected": "green"},
        {  # HH-RLHF / UltraFeedback: whole conversations sharing the prompt's turns
            "chosen": [*SKY, {"role": "assistant", "content": "blue"}],
            "rejected": [*SKY, {"role": "assistant", "content": "green"}],
        },
        {  # ShareGPT conversations with final turns
            "conversations": [{"from": "human", "value": "Colour of the sky?"}],
            "chosen": {"from": "gpt", "value": "blue"},
            "rejected": {"from": "gpt", "value": "green"},
        },
        {  # UltraFeedback-binarized: the prompt as a string, each side the whole conversation repeating it
            "prompt": "Colour of the sky?",
            "chosen": [*SKY, {"role": "assistant", "content": "blue"}],
            "rejected": [*SKY, {"role": "assistant", "content": "green"}],
        },
        {  # HH-RLHF: plain-text transcripts
            "chosen": "\n\nHuman: Colour of the sky?\n\nAssistant: blue",
            "rejected": "\n\nHuman: Colour of the sky?\n\nAssistant: green",
        },
    ],
    ids=["strings", "turns", "shared-prefix", "sharegpt", "ultrafeedback", "hh-rlhf"],
)
def test_every_shape_reads_as_the_same_pair(row):
    pair = parse_pair(row)
    assert pair.prompt == SKY
    assert pair.chosen == [{"role": "assistant", "content": "blue"}]
    assert pair.rejected == [{"role": "assistant", "content": "green"}]


@pytest.mark.parametrize(
    ("row", "reason"),
    [
        ({"prompt": "q", "chosen": "a"}, "missing field 'rejected'"),
        ({"prompt": "q", "chosen": "a", "rejected": "a"}, "chosen equals rejected"),
        ({"prompt": "q", "chosen": "  ", "rejected": "b"}, "chosen is empty"),
        ({"chosen": "a", "rejected": "b"}, "give a `prompt` field"),
        (  # whole conversations that do not repeat the prompt: named, not a template error
            {
                "prompt": "Colour of the sky?",
                "chosen": [{"role": "user", "content": "Colour of the sea?"}, {"role": "assistant", "content": "b"}],
                "rejected": [{"role": "user", "content": "Colour of the sea?"}, {"role": "assistant", "content": "g"}],
            },
            "chosen begins with a user turn after the prompt.*repeat the prompt exactly",
        ),
        (
            {
                "prompt": "q",
                "chosen": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}],
                "rejected": "b",
            },
            "last turn must be the assistant",
        ),
    ],
)
def test_a_bad_pair_says_why(row, reason):
    with pytest.raises(RowError, match=reason):
        parse_pair(row)


def test_one_row_per_pair_labels_only_the_completions(tokenizer):
    (example,) = tokenize_pairs(
        tokenizer, [parse_pair({"prompt": SKY, "chosen": "blue", "rejected": "green"})], 64, None, "right"
    )
    ids, labels, positions = example.input_ids, example.labels, example.positions
    second = positions.index(0, 1)  # the rejected side starts again at position 0
    chosen, rejected = slice(0, second), slice(second, len(ids))
    trained = [
        tokenizer.decode([t for t, lab in zip(ids[side], labels[side], strict=True) if lab != IGNORE])
        for side in (chosen, rejected)
    ]
    assert trained[0].startswith("blue") and trained[0].endswith(tokenizer.eos_token)
    assert trained[1].startswith("green") and trained[1].endswith(tokenizer.eos_token)
    context = tokenizer.decode([t for t, lab in zip(ids[chosen], labels[chosen], strict=True) if lab == IGNORE])
    assert "Colour of the sky?" in context and "blue" not in context
    first = [next(i for i, lab in enumerate(labels[side]) if lab != IGNORE) for side in (chosen, rejected)]
    assert first[0] == first[1] and ids[chosen][: first[0]] == ids[rejected][: first[1]]  # the same prompt


def test_truncation_rules_keep_the_prompts_end_then_cut_the_completion():
    prompt, chosen, rejected = list(range(100, 120)), list(range(200, 230)), list(range(300, 305))
    example = pair_row(prompt, chosen, rejected, seq_len=24, max_prompt=8, truncation="right")
    assert example.prompt_truncated and example.completion_truncated
    assert example.input_ids[:8] == prompt[-8:]  # the prompt keeps its end: the turn the completion answers
    assert example.input_ids[8:24] == chosen[:16]  # the completion fills the rest of seq_len
    assert example.input_ids[24:] == prompt[-8:] + rejected  # the short side whole
    assert sum(label != IGNORE for label in example.labels) == 16 + 5
    with pytest.raises(RowError, match="no room for the chosen completion"):
        pair_row(prompt, chosen, rejected, seq_len=20, max_prompt=None, truncation="right")
    with pytest.raises(RowError, match="data.truncation=drop"):
        pair_row(prompt, chosen, rejected, seq_len=24, max_prompt=8, truncation="drop")
    with pytest.raises(RowError, match="equals rejected after truncation"):
        pair_row(prompt, [1, 2, 3, 4], [1, 2, 3, 5], seq_len=11, max_prompt=8, truncation="right")


def test_prepare_reports_drops_and_truncations(tiny_model, tmp_path):
    rows = [
        {"prompt": "What is 2+2?", "chosen": "4", "rejected": "5"},
        {"prompt": "Say hi " * 30, "chosen": "hi", "rejected": "no"},
        {"prompt": "same", "chosen": "x", "rejected": "x"},
        {"prompt": "one side", "chosen": "x"},
    ]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DataConfig(path=str(path), seq_len=48, max_prompt_tokens=16, eval_ratio=0.0, max_bad_fraction=0.6)
    prepared = prepare(cfg, tiny_model, str(tmp_path / "out"), objective="dpo")
    report = prepared.report
    assert report.format == "preference" and report.train_examples == 2 and prepared.seq_len == 96
    assert report.prompt_truncations == 1
    assert sorted(d["reason"] for d in report.dropped) == [
        "chosen equals rejected: the pair prefers nothing",
        "missing field 'rejected': a preference pair needs both chosen and rejected",
    ]
    columns = read_rows(storage.read_bytes(storage.join(prepared.url, prepared.shards["train"][0])))
    assert all(len(ids) == 96 for ids in columns["input_ids"])
    assert prepared.fingerprint == fingerprint(cfg, tiny_model, "dpo") != fingerprint(cfg, tiny_model)


PAIRS_12 = [(f"What is {i} plus {i}?", f"It is {2 * i}.", f"It is {2 * i + 1}.") for i in range(12)]
PUBLIC_SHAPES = {
    "trl-standard": lambda q, a, b: {"prompt": q, "chosen": a, "rejected": b},
    "trl-conversational": lambda q, a, b: {
        "prompt": [{"role": "user", "content": q}],
        "chosen": [{"role": "assistant", "content": a}],
        "rejected": [{"role": "assistant", "content": b}],
    },
    "trl-implicit-prompt": lambda q, a, b: {
        "chosen": [{"role": "user", "content": q}, {"role": "assistant", "content": a}],
        "rejected": [{"role": "user", "content": q}, {"role": "assistant", "content": b}],
    },
    "ultrafeedback-binarized": lambda q, a, b: {
        "prompt": q,
        "prompt_id": "0" * 64,
        "chosen": [{"role": "user", "content": q}, {"role": "assistant", "content": a}],
        "rejected": [{"role": "user", "content": q}, {"role": "assistant", "content": b}],
        "score_chosen": 8.0,
        "score_rejected": 3.5,
    },
    "hh-rlhf": lambda q, a, b: {
        "chosen": f"\n\nHuman: {q}\n\nAssistant: {a}",
        "rejected": f"\n\nHuman: {q}\n\nAssistant: {b}",
    },
}


def test_every_public_preference_shape_prepares_to_the_same_rows(tiny_model, tmp_path):
    """The same 12 pairs written in each public shape (TRL's three, UltraFeedback-binarized's, HH-RLHF's text)
    prepare with no row dropped, to the very same token rows (and, through SmolLM2's template, the real DPO
    recipe's base, they render to the same rows too: below)."""
    base = tiny_model
    pairs = PAIRS_12
    rows = {}
    for shape, write in PUBLIC_SHAPES.items():
        path = tmp_path / f"{shape}.jsonl"
        path.write_text("".join(json.dumps(write(*p)) + "\n" for p in pairs))
        cfg = DataConfig(path=str(path), seq_len=64, eval_ratio=0.0, max_bad_fraction=0.0)
        prepared = prepare(cfg, base, str(tmp_path / shape), objective="dpo")
        assert prepared.report.format == "preference" and prepared.report.dropped == [], (shape, prepared.report)
        assert prepared.report.train_examples == 12, shape
        rows[shape] = read_rows(storage.read_bytes(storage.join(prepared.url, prepared.shards["train"][0])))
    first = rows["trl-standard"]
    for shape, columns in rows.items():
        assert columns["input_ids"] == first["input_ids"] and columns["labels"] == first["labels"], shape
    # Mixed as data.sources: UltraFeedback's file whole beside 6 of HH-RLHF's, each read its own way, the same rows.
    cfg = DataConfig(
        sources=[
            {"path": str(tmp_path / "ultrafeedback-binarized.jsonl")},
            {"path": str(tmp_path / "hh-rlhf.jsonl"), "rows": 6},
        ],
        seq_len=64,
        eval_ratio=0.0,
        max_bad_fraction=0.0,
    )
    mixed = prepare(cfg, base, str(tmp_path / "mix"), objective="dpo")
    assert mixed.report.dropped == [] and [m["train_examples"] for m in mixed.report.mix] == [12, 6]
    mixed_rows = read_rows(storage.read_bytes(storage.join(mixed.url, mixed.shards["train"][0])))
    assert len(mixed_rows["input_ids"]) == 18 and all(row in first["input_ids"] for row in mixed_rows["input_ids"])


def test_every_public_preference_shape_renders_alike_through_smollm2s_template():
    """SmolLM2's chat template (the real DPO recipe's base), where UltraFeedback's shape used to fail every row
    with "not prefix-stable": each shape's pairs tokenize to the same rows, none refused."""
    from ladle.assets import resolve_base

    tokenizer = AutoTokenizer.from_pretrained(resolve_base("ladle://smollm2-135m-instruct", "float32"))
    made = {
        shape: tokenize_pairs(tokenizer, [parse_pair(write(*p)) for p in PAIRS_12], 64, None, "right")
        for shape, write in PUBLIC_SHAPES.items()
    }
    first = made["trl-standard"]
    assert not any(isinstance(e, RowError) for e in first)
    for shape, examples in made.items():
        assert [(e.input_ids, e.labels) for e in examples] == [(e.input_ids, e.labels) for e in first], shape


def test_the_objective_and_the_rows_must_agree(tiny_model, tmp_path):
    pairs, chats = tmp_path / "pairs.jsonl", tmp_path / "chat.jsonl"
    pairs.write_text(json.dumps({"prompt": "q", "chosen": "a", "rejected": "b"}) + "\n")
    chats.write_text(json.dumps({"instruction": "q", "output": "a"}) + "\n")
    with pytest.raises(LadleError, match="rows are preference pairs.*Set training.objective=dpo"):
        prepare(DataConfig(path=str(pairs)), tiny_model, str(tmp_path / "a"))
    with pytest.raises(LadleError, match=r"training.objective = dpo needs preference pairs.*first record.*alpaca"):
        prepare(DataConfig(path=str(chats)), tiny_model, str(tmp_path / "b"), objective="dpo")
    with pytest.raises(LadleError, match="data.format = alpaca with training.objective = dpo"):
        prepare(DataConfig(path=str(pairs), format="alpaca"), tiny_model, str(tmp_path / "c"), objective="dpo")
    with pytest.raises(LadleError, match="data.format = preference with training.objective = sft"):
        prepare(DataConfig(path=str(pairs), format="preference"), tiny_model, str(tmp_path / "d"))


def test_pairs_share_the_system_prompt_and_dedup():
    from ladle.data.prepare import sample_key, with_system

    pair = parse_pair({"prompt": "q", "chosen": "a", "rejected": "b"})
    system = with_system(pair, "Be brief.")
    assert isinstance(system, Pair) and system.prompt[0] == {"role": "system", "content": "Be brief."}
    assert sample_key(pair) == sample_key(parse_pair({"prompt": "q", "chosen": "a", "rejected": "b"}))
    assert sample_key(pair) != sample_key(parse_pair({"prompt": "q", "chosen": "a", "rejected": "c"}))


def test_inspect_and_show_mask_read_pairs_as_the_trainer_does(tiny_model, tmp_path):
    """`ladle data inspect` and `show-mask` on a preference config: the pairs' format, and each pair's row with
    only the two completions trained."""
    from tests.helpers import run_cli

    config = tmp_path / "dpo.yaml"
    config.write_text(
        "base: ladle://tiny-llama\ndata: {path: ladle://demo-preference, seq_len: 64}\ntraining: {objective: dpo}\n"
    )
    info = json.loads(run_cli("data", "inspect", str(config), "--json").stdout.strip().splitlines()[-1])
    assert info["format"] == "preference" and info["invalid"] == 0 and info["samples"][0]["sample"]["chosen"]
    shown = run_cli("data", "show-mask", str(config), "-n", "1", "--json")
    (row,) = json.loads(shown.stdout.strip().splitlines()[-1])["rows"]
    trained = "".join(piece for piece, on in row["tokens"] if on)
    first = json.loads(open(info["files"][0]["url"]).readline())  # noqa: SIM115 - one line of a local file
    assert trained.count("<|end|>") == 2 and first["chosen"] in trained and first["rejected"] in trained
    assert first["prompt"].split("\n")[0] not in trained
