import json

import pytest
import torch

from ladle.config import DataConfig
from ladle.data.formats import Chat
from ladle.data.packing import first_fit_decreasing, pack_examples, read_rows
from ladle.data.prepare import IGNORE, check_not_empty, fingerprint, prepare
from ladle.data.tokenize import tokenize_batch
from ladle.errors import LadleError
from ladle.platform import storage


def render_example(tokenizer, messages, train_on, seq_len, truncation="right"):
    ((result, truncated),) = tokenize_batch(tokenizer, [Chat(messages)], train_on, seq_len, truncation)
    if isinstance(result, Exception):
        raise result
    return result, truncated


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def test_alpaca_labels_only_response_through_eos(tokenizer):
    messages = [{"role": "user", "content": "Add 2 and 3."}, {"role": "assistant", "content": "5"}]
    example, truncated = render_example(tokenizer, messages, "response", 256)
    prompt = tokenizer("<s><|user|>\nAdd 2 and 3.<|end|>\n<|assistant|>\n", add_special_tokens=False).input_ids
    answer = tokenizer("5<|end|>", add_special_tokens=False).input_ids
    tail = tokenizer("\n", add_special_tokens=False).input_ids
    assert example.input_ids == prompt + answer + tail
    assert example.labels == [IGNORE] * len(prompt) + answer + [IGNORE] * len(tail)
    assert answer[-1] == tokenizer.eos_token_id
    assert not truncated


def test_multi_turn_trains_every_assistant_turn(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "Bye now"},
    ]
    example, _ = render_example(tokenizer, messages, "response", 256)
    trained = tokenizer.decode(
        [t for t, label in zip(example.input_ids, example.labels, strict=False) if label != IGNORE]
    )
    assert trained == "Hello<|end|>Bye now<|end|>"


def test_train_on_all_labels_everything_but_first(tokenizer):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    example, _ = render_example(tokenizer, messages, "all", 256)
    assert example.labels[0] == IGNORE
    assert example.labels[1:] == example.input_ids[1:]


def test_first_fit_decreasing():
    assert first_fit_decreasing([5, 4, 3, 2, 1], 6) == [[0, 4], [1, 3], [2]]
    assert first_fit_decreasing([], 4) == []


def test_packing_keeps_every_token_and_resets_positions(tokenizer):
    from ladle.data.prepare import Example

    examples = [
        Example([1, 7, 8], [IGNORE, 7, 8]),
        Example([1, 9], [IGNORE, 9]),
        Example([1, 5, 6, 4], [IGNORE, 5, 6, 4]),
    ]
    rows = pack_examples(examples, 8, pad_id=0)
    assert len(rows) == 2
    assert rows.real_tokens == 9
    assert rows.position_ids[0] == [0, 1, 2, 3, 0, 1, 2, 0]
    assert rows.labels[1][-5:] == [IGNORE] * 5


def test_packed_loss_equals_token_weighted_loss_of_sequences(tiny_model, tokenizer):
    """No attention across packed sequences: a packed row's loss is its sequences' loss, token-weighted."""
    from transformers import AutoModelForCausalLM

    from ladle.train.loss import token_loss

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    convs = [
        [{"role": "user", "content": "Reverse the word: kalo"}, {"role": "assistant", "content": "olak"}],
        [{"role": "user", "content": "Add 4 and 9."}, {"role": "assistant", "content": "13"}],
        [{"role": "user", "content": "Repeat the input.\nsu ta ri"}, {"role": "assistant", "content": "su ta ri"}],
    ]
    examples = [render_example(tokenizer, c, "response", 128)[0] for c in convs]
    packed = pack_examples(examples, 128, tokenizer.pad_token_id)
    assert len(packed) == 1
    as_tensors = lambda rows: {k: torch.tensor(v) for k, v in rows.__dict__.items() if k != "real_tokens_per_row"}  # noqa: E731
    with torch.no_grad():
        packed_sum, packed_count = token_loss(model, as_tensors(packed), [0], "cpu")
        sums = [
            token_loss(model, as_tensors(pack_examples([e], 128, tokenizer.pad_token_id)), [0], "cpu") for e in examples
        ]
    assert packed_count == sum(c for _, c in sums)
    assert torch.allclose(packed_sum, sum(s for s, _ in sums), rtol=1e-5, atol=1e-5)


def test_prepare_writes_shards_manifest_and_report(tiny_model, tmp_path):
    data = write_jsonl(
        tmp_path / "d.jsonl", [{"instruction": f"Add {i} and 1.", "input": "", "output": str(i + 1)} for i in range(50)]
    )
    cfg = DataConfig(path=str(data), eval_ratio=0.2, seq_len=64)
    prepared = prepare(cfg, tiny_model, str(tmp_path / "out"))
    assert storage.is_complete(prepared.url)
    report = prepared.report
    assert (report.rows_read, report.rows_used) == (50, 50)
    assert report.train_examples + report.eval_examples == 50 and 4 <= report.eval_examples <= 18  # seeded hash split
    assert report.dropped == [] and report.format == "alpaca"
    rows = read_rows(storage.read_bytes(storage.join(prepared.url, prepared.shards["train"][0])))
    assert len(rows["input_ids"]) == prepared.train_rows and all(len(r) == 64 for r in rows["input_ids"])
    assert 0 < report.packing_efficiency <= 1
    assert prepare(cfg, tiny_model, str(tmp_path / "out")) == prepared  # found, not redone


def test_bad_rows_reported_with_line_numbers(tiny_model, tmp_path):
    good = [json.dumps({"instruction": "Add 1 and 1.", "input": "", "output": "2"})] * 8
    lines = (
        good[:2]
        + ["{not json"]
        + good[2:4]
        + ["", json.dumps({"instruction": "x"})]
        + good[4:]
        + [json.dumps({"instruction": 3, "output": "y"})]
    )
    data = tmp_path / "d.jsonl"
    data.write_bytes(("\n".join(lines) + "\n").encode() + b"\xff\xfe\n")
    cfg = DataConfig(path=str(data), eval_ratio=0.0, seq_len=64, max_bad_fraction=0.5)
    report = prepare(cfg, tiny_model, str(tmp_path / "out")).report
    assert [(d["line"], d["reason"].split(" (")[0]) for d in report.dropped] == [  # noqa: E501
        (3, "malformed JSON"),
        (7, "missing field 'output'"),
        (12, "field 'instruction' must be a string, got int"),
        (13, "invalid UTF-8"),
    ]
    assert report.rows_read == 12 and report.rows_used == 8


def test_too_many_bad_rows_fail_with_the_count(tiny_model, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [{"instruction": "Add 1 and 1.", "output": "2"}] * 9 + ["{bad"])
    with pytest.raises(
        LadleError, match=r"1 of 10 rows unusable \(10.0% > data.max_bad_fraction=0.01; line 10: malformed JSON"
    ):
        prepare(DataConfig(path=str(data), seq_len=64), tiny_model, str(tmp_path / "out"))


def test_empty_dataset(tmp_path):
    data = tmp_path / "empty.jsonl"
    data.write_text("\n\n")
    with pytest.raises(LadleError, match=r"data.path = .*empty.jsonl': the dataset is empty \(0 rows\)"):
        check_not_empty(str(data))


def test_missing_data_file(tmp_path):
    with pytest.raises(LadleError, match=r"data.path = .*nope.jsonl': no such file"):
        check_not_empty(str(tmp_path / "nope.jsonl"))


def test_fingerprint_follows_content_and_options(tiny_model, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [{"instruction": "a", "output": "b"}])
    base = fingerprint(DataConfig(path=str(data)), tiny_model)
    assert fingerprint(DataConfig(path=str(data)), tiny_model) == base
    assert fingerprint(DataConfig(path=str(data), seq_len=128), tiny_model) != base
    write_jsonl(data, [{"instruction": "a", "output": "c"}])
    assert fingerprint(DataConfig(path=str(data)), tiny_model) != base


def test_split_writer_packs_window_by_window_into_shards(tmp_path):
    from ladle.data.packing import SplitWriter
    from ladle.data.prepare import Example

    writer = SplitWriter(str(tmp_path), "train", seq_len=16, pad_id=0, pack=True, window=5)
    writer.shard_rows = 3
    examples = [Example([1] + [7] * (i % 6 + 2), [IGNORE] + [7] * (i % 6 + 2)) for i in range(23)]
    for example in examples:
        writer.add(example)
        assert len(writer.pending) < 5  # never more than one window held
    writer.close()
    rows = [read_rows(storage.read_bytes(storage.join(str(tmp_path), s))) for s in writer.shards]
    assert len(writer.shards) > 1 and all(len(r["input_ids"]) <= 3 for r in rows)
    assert sum(sum(r["real_tokens"]) for r in rows) == sum(len(e.input_ids) for e in examples) == writer.real_tokens
    assert writer.total_rows == sum(len(r["input_ids"]) for r in rows)
