"""Each format, through the whole prepare path, yields the hand-computed tokens and labels."""

from __future__ import annotations

import csv
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ladle.config import DataConfig
from ladle.data.packing import read_rows
from ladle.data.prepare import IGNORE, prepare
from ladle.errors import LadleError
from ladle.platform import storage


def reference(tokenizer, pieces: list[tuple[str, bool]]) -> tuple[list[int], list[int]]:
    """Tokenize text pieces one by one; ``True`` pieces carry a loss. The first label is never trained."""
    ids, labels = [], []
    for text, trained in pieces:
        piece = tokenizer(text, add_special_tokens=False).input_ids
        ids += piece
        labels += piece if trained else [IGNORE] * len(piece)
    labels[0] = IGNORE
    return ids, labels


def write(path, kind: str, rows: list[dict]):
    if kind == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif kind == "json":
        path.write_text(json.dumps(rows))
    elif kind == "parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    elif kind == "csv":
        with path.open("w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return path


def prepared_row(tmp_path, tiny_model, data, **opts):
    cfg = DataConfig(path=str(data), eval_ratio=0.0, seq_len=96, pack=False, **opts)
    prepared = prepare(cfg, tiny_model, str(tmp_path / "out"))
    rows = read_rows(storage.read_bytes(storage.join(prepared.url, prepared.shards["train"][0])))
    real = rows["real_tokens"][0]
    return rows["input_ids"][0][:real], rows["labels"][0][:real], prepared.report


ALPACA = {"instruction": "Add 2 and 3.", "input": "now", "output": "5"}
SHAREGPT = {
    "conversations": [
        {"from": "system", "value": "Be brief."},
        {"from": "human", "value": "Hi"},
        {"from": "gpt", "value": "Hello"},
        {"from": "human", "value": "Bye"},
        {"from": "gpt", "value": "Bye now"},
    ]
}
MESSAGES = {"messages": [{"role": "user", "content": "Reverse: ab"}, {"role": "assistant", "content": "ba"}]}


def expected_alpaca(t):
    return reference(
        t, [("<s><|user|>\nAdd 2 and 3.\nnow<|end|>\n<|assistant|>\n", False), ("5<|end|>", True), ("\n", False)]
    )


def expected_sharegpt(t):
    return reference(
        t,
        [
            ("<s><|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\n", False),
            ("Hello<|end|>", True),
            ("\n<|user|>\nBye<|end|>\n<|assistant|>\n", False),
            ("Bye now<|end|>", True),
            ("\n", False),
        ],
    )


def expected_messages(t):
    return reference(
        t, [("<s><|user|>\nReverse: ab<|end|>\n<|assistant|>\n", False), ("ba<|end|>", True), ("\n", False)]
    )


@pytest.mark.parametrize(
    "kind, row, expected",
    [
        ("jsonl", ALPACA, expected_alpaca),
        ("csv", ALPACA, expected_alpaca),
        ("json", SHAREGPT, expected_sharegpt),
        ("parquet", MESSAGES, expected_messages),
    ],
)
def test_chat_formats_match_reference(tmp_path, tiny_model, tokenizer, kind, row, expected):
    ids, labels, report = prepared_row(tmp_path, tiny_model, write(tmp_path / f"d.{kind}", kind, [row]))
    assert (ids, labels) == expected(tokenizer)
    assert report.rows_used == 1 and report.dropped == []


def test_plain_text_trains_every_token(tmp_path, tiny_model, tokenizer):
    ids, labels, report = prepared_row(
        tmp_path, tiny_model, write(tmp_path / "d.jsonl", "jsonl", [{"text": "ka lo mi"}])
    )
    assert (ids, labels) == reference(tokenizer, [("<s>ka lo mi<|end|>", True)])
    assert report.format == "text"


def test_pretokenized_with_and_without_labels(tmp_path, tiny_model):
    rows = [{"input_ids": [1, 40, 41, 42, 2], "labels": [-100, -100, 41, 42, 2]}]
    ids, labels, report = prepared_row(tmp_path, tiny_model, write(tmp_path / "a.jsonl", "jsonl", rows))
    assert (ids, labels, report.format) == ([1, 40, 41, 42, 2], [-100, -100, 41, 42, 2], "tokenized")
    ids, labels, _ = prepared_row(
        tmp_path, tiny_model, write(tmp_path / "b.jsonl", "jsonl", [{"input_ids": [1, 7, 8]}])
    )
    assert labels == [-100, 7, 8]


def test_train_on_all_includes_prompt(tmp_path, tiny_model, tokenizer):
    ids, labels, _ = prepared_row(tmp_path, tiny_model, write(tmp_path / "d.jsonl", "jsonl", [ALPACA]), train_on="all")
    assert labels[1:] == ids[1:]


def test_preference_pairs_for_sft_point_at_the_objective(tmp_path, tiny_model):
    data = write(tmp_path / "d.jsonl", "jsonl", [{"prompt": "p", "chosen": "a", "rejected": "b"}])
    with pytest.raises(LadleError, match="preference pairs \\(chosen/rejected\\) and training.objective = sft"):
        prepare(DataConfig(path=str(data)), tiny_model, str(tmp_path / "out"))


def test_bad_records_per_format(tmp_path, tiny_model):
    rows = [
        MESSAGES,
        {"messages": []},
        {"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]},
        {"messages": [{"role": "user", "content": "x"}]},
        {"messages": "hello"},
        {"conversations": [{"from": "gpt", "value": "x"}]},
    ]
    data = write(tmp_path / "d.jsonl", "jsonl", rows)
    report = prepare(
        DataConfig(path=str(data), format="messages", eval_ratio=0, max_bad_fraction=1.0),
        tiny_model,
        str(tmp_path / "o"),
    ).report
    assert [(d["line"], d["reason"]) for d in report.dropped] == [
        (2, "empty conversation"),
        (3, "messages[0].role = 'robot': unknown role (known: system, user, assistant, tool)"),
        (4, "no assistant turn to train on"),
        (5, "field 'messages' must be a list of turns, got str"),
        (6, "missing field 'messages'"),
    ]


def test_file_not_of_its_declared_format(tmp_path, tiny_model):
    fake = tmp_path / "d.parquet"
    fake.write_text('{"text": "not parquet"}\n')
    with pytest.raises(LadleError, match="not a Parquet file"):
        prepare(DataConfig(path=str(fake)), tiny_model, str(tmp_path / "o"))
    csv_as_jsonl = tmp_path / "d.jsonl"
    csv_as_jsonl.write_text("instruction,output\nAdd 1 and 1.,2\n")
    report_error = pytest.raises(
        LadleError, match=r"no usable training rows \(read 2, dropped 2; line 1: malformed JSON"
    )
    with report_error:
        prepare(DataConfig(path=str(csv_as_jsonl), format="alpaca"), tiny_model, str(tmp_path / "o"))


def test_truncation_policies(tmp_path, tiny_model):
    long = {"instruction": "Repeat the input.", "input": "kalo", "output": " ".join(["kalo"] * 80)}
    data = write(tmp_path / "d.jsonl", "jsonl", [ALPACA, long])
    cut = prepare(DataConfig(path=str(data), seq_len=64, eval_ratio=0), tiny_model, str(tmp_path / "a")).report
    assert (cut.truncations, cut.rows_used, cut.too_long) == (1, 2, 0)
    dropped = prepare(
        DataConfig(path=str(data), seq_len=64, eval_ratio=0, truncation="drop"), tiny_model, str(tmp_path / "b")
    ).report
    assert (dropped.truncations, dropped.rows_used, dropped.too_long, dropped.invalid_rows) == (0, 1, 1, 0)
    assert dropped.dropped[0]["line"] == 2 and dropped.dropped[0]["reason"].startswith("too long:")


def test_dedup_counts_exact_duplicates(tmp_path, tiny_model):
    other = {**ALPACA, "output": "6"}
    data = write(tmp_path / "d.jsonl", "jsonl", [ALPACA, other, ALPACA, ALPACA])
    report = prepare(DataConfig(path=str(data), eval_ratio=0, dedup=True), tiny_model, str(tmp_path / "o")).report
    assert (report.rows_read, report.rows_used, report.duplicates_removed) == (4, 2, 2)


def test_globs_and_memory_urls(tmp_path, tiny_model):
    import fsspec

    for i in range(3):
        write(tmp_path / f"part-{i}.jsonl", "jsonl", [{"instruction": f"Add {i} and 1.", "output": str(i + 1)}])
    report = prepare(
        DataConfig(path=str(tmp_path / "part-*.jsonl"), eval_ratio=0), tiny_model, str(tmp_path / "o")
    ).report
    assert report.rows_used == 3 and len(report.sources) == 3
    with fsspec.open("memory://ladle-test/rows.jsonl", "w") as fh:
        fh.write(json.dumps(ALPACA) + "\n")
    assert (
        prepare(
            DataConfig(path="memory://ladle-test/rows.jsonl", eval_ratio=0), tiny_model, str(tmp_path / "m")
        ).report.rows_used
        == 1
    )


def test_s3_input(tmp_path, tiny_model, s3_server, monkeypatch):
    import fsspec

    for key, value in s3_server.items():
        monkeypatch.setenv(key, value)
    for i in range(2):
        with fsspec.open(f"s3://ladle/input/part-{i}.jsonl", "w") as fh:
            fh.write(
                "".join(json.dumps({"instruction": f"Add {i} and {j}.", "output": str(i + j)}) + "\n" for j in range(5))
            )
    prepared = prepare(DataConfig(path="s3://ladle/input/part-*.jsonl", eval_ratio=0.2), tiny_model, "s3://ladle/prep")
    assert prepared.report.rows_used == 10 and prepared.report.sources[0].startswith("s3://ladle/input/part-0")
    assert storage.is_complete(prepared.url)


def test_doubled_bos_is_reported(tmp_path, tiny_model):
    data = write(tmp_path / "d.jsonl", "jsonl", [{"text": "ka lo"}, {"text": "<s>ka lo"}])
    report = prepare(
        DataConfig(path=str(data), eval_ratio=0, max_bad_fraction=0.5), tiny_model, str(tmp_path / "o")
    ).report
    assert report.dropped == [
        {"line": 2, "reason": "BOS token doubled (the text or template adds it twice)", "source": str(data)}
    ]


def test_separate_eval_file(tmp_path, tiny_model):
    train = write(tmp_path / "train.jsonl", "jsonl", [{**ALPACA, "output": str(i)} for i in range(6)])
    evals = write(tmp_path / "eval.jsonl", "jsonl", [ALPACA, {"oops": 1}])
    cfg = DataConfig(path=str(train), eval_path=str(evals), max_bad_fraction=0.2)
    report = prepare(cfg, tiny_model, str(tmp_path / "o")).report
    assert (report.train_examples, report.eval_examples, report.rows_read) == (6, 1, 8)
    assert report.dropped[0]["line"] == 2 and report.dropped[0]["source"] == str(evals)
