"""data.sources: several sources mixed by weight, rows or epochs, each read with its own options."""

import json
from collections import Counter

import pytest
from rich.console import Console

from ladle.cli.data import mix_table
from ladle.config import DataConfig, build_config
from ladle.data import mix
from ladle.data.inspect import mask_rows
from ladle.data.prepare import fingerprint, prepare, resolve_parts
from ladle.errors import ConfigError, LadleError
from ladle.platform import storage


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def three_sources(tmp_path):
    """Instructions (alpaca), chats (ShareGPT) and a small rehearsal set (messages) with a bad row."""
    alpaca = write_jsonl(
        tmp_path / "own.jsonl", [{"instruction": f"Add {i} and 1.", "output": str(i + 1)} for i in range(60)]
    )
    chats = write_jsonl(
        tmp_path / "public.jsonl",
        [
            {"conversations": [{"from": "human", "value": f"Name {i}."}, {"from": "gpt", "value": f"n{i}"}]}
            for i in range(50)
        ],
    )
    rehearsal = [
        {"messages": [{"role": "user", "content": f"Recall {i}."}, {"role": "assistant", "content": f"r{i}"}]}
        for i in range(12)
    ]
    rehearsal.insert(5, {"messages": "not a list"})
    small = write_jsonl(tmp_path / "rehearsal.jsonl", rehearsal)
    return [
        {"path": alpaca, "weight": 2},
        {"path": chats, "weight": 1, "format": "sharegpt"},
        {"path": small, "epochs": 3, "system_prompt": "Remember.", "train_on": "all"},
    ]


def test_three_sources_mix_as_asked_each_read_its_own_way(tiny_model, tmp_path):
    """Weights share what the weighted sources give without repeating a row, epochs repeat a source in passes,
    each source keeps its format, system prompt and trained tokens, the held-out rows are each source's own,
    and the same config prepares the same bytes (another seed: another sample)."""
    cfg = DataConfig(sources=three_sources(tmp_path), eval_ratio=0.1, seq_len=64, max_bad_fraction=0.05, seed=3)
    prepared = prepare(cfg, tiny_model, str(tmp_path / "out"))
    report = prepared.report
    own, public, rehearsal = report.mix
    assert [m["name"] for m in report.mix] == ["own", "public", "rehearsal"]
    assert report.format == "alpaca+sharegpt+messages"
    # The weighted pair: as many rows as 2:1 allows without a repeat; `public` (50 rows for a third) is sampled,
    # `own` (60 rows for two thirds) is the source that runs out first, used whole.
    assert own["target_rows"] == own["training_records"] and own["train_examples"] == own["target_rows"]
    assert public["target_rows"] == own["target_rows"] // 2 < public["training_records"]
    assert public["not_sampled"] == public["training_records"] - public["target_rows"]
    assert public["train_examples"] == public["target_rows"]
    # epochs: 3 passes over the rehearsal set; its bad row is reported once, not once a pass.
    assert rehearsal["passes"] == 3 and rehearsal["dropped"] == 1
    assert rehearsal["train_examples"] == 3 * (rehearsal["training_records"] - 1)
    assert [d["line"] for d in report.dropped] == [6] and report.invalid_rows == 1
    for m in report.mix:  # achieved = asked, up to the one bad row
        assert m["achieved_share"] == pytest.approx(m["asked_share"], abs=0.02), m
        assert m["eval_examples"] == m["held_out"] or (m["name"] == "rehearsal" and m["eval_examples"] < m["held_out"])
        assert m["rows_read"] == m["training_records"] + m["held_out"]
    assert sum(m["eval_examples"] for m in report.mix) == report.eval_examples
    assert report.rows_read == sum(m["rows_read"] for m in report.mix)
    # `ladle data prepare` prints the mix as a table: each source's ask, rows and shares.
    console = Console(record=True, width=200)
    console.print(mix_table(report.mix))
    lines = console.export_text().splitlines()
    row = next(line for line in lines if "rehearsal" in line)
    assert "epochs 3" in row and f"{rehearsal['train_examples']:,}" in row and f"{rehearsal['asked_share']:.1%}" in row
    # Each source tokenized its own way: the rehearsal rows open with their system turn and train on all tokens.
    shown = {row["source"].rsplit("/", 1)[-1]: row for row in mask_rows(cfg, tiny_model, n=1)}
    rehearsal_row = shown["rehearsal.jsonl"]
    assert "Remember" in "".join(t for t, _ in rehearsal_row["tokens"])
    assert rehearsal_row["trained"] == rehearsal_row["total"] - 1
    assert shown["own.jsonl"]["trained"] < shown["own.jsonl"]["total"] - 1  # own: the response only
    # Reproducible to the byte; another seed samples other rows.
    again = prepare(cfg, tiny_model, str(tmp_path / "again"))
    shard = prepared.shards["train"][0]
    assert storage.read_bytes(storage.join(again.url, shard)) == storage.read_bytes(storage.join(prepared.url, shard))
    assert fingerprint(cfg.model_copy(update={"seed": 4}), tiny_model) != prepared.fingerprint
    weights = [{**s, "weight": 3} if i == 0 else s for i, s in enumerate(three_sources(tmp_path))]
    assert fingerprint(DataConfig(**{**cfg.model_dump(), "sources": weights}), tiny_model) != prepared.fingerprint


def test_the_stream_holds_the_mix_in_every_window(tmp_path):
    """Stride scheduling: each source's used rows are spread through the stream, so a packing window of any size
    holds the mix (within one row of each share), and the selection is exact and seeded."""
    a = write_jsonl(tmp_path / "a.jsonl", [{"text": f"a{i}"} for i in range(300)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"text": f"b{i}"} for i in range(100)])
    c = write_jsonl(tmp_path / "c.jsonl", [{"text": f"c{i}"} for i in range(40)])
    cfg = DataConfig(
        sources=[{"path": a, "weight": 5}, {"path": b, "weight": 3}, {"path": c, "rows": 90}], eval_ratio=0.0
    )
    found = resolve_parts(cfg, "sft")
    assert [p.target for p in found] == [166, 100, 90]  # b limits the weighted pair: 100 / (3/8) * (5/8) = 166
    used = [i.part.index for i in mix.stream(cfg, found) if i.use]
    assert Counter(used) == {0: 166, 1: 100, 2: 90}
    total = len(used)
    for window in (10, 37, 100):
        for start in range(0, total - window, window):
            seen = Counter(used[start : start + window])
            for p in found:
                assert abs(seen[p.index] - window * p.target / total) <= 1.5, (window, start, seen)
    # c: 90 rows of 40 = two whole passes and 10 sampled, exactly, the same rows for the same seed.
    rows_c = [i.row["text"] for i in mix.stream(cfg, found) if i.use and i.part.index == 2]
    assert Counter(Counter(rows_c).values()) == {3: 10, 2: 30}
    assert rows_c == [i.row["text"] for i in mix.stream(cfg, resolve_parts(cfg, "sft")) if i.use and i.part.index == 2]
    other = cfg.model_copy(update={"seed": 1})
    assert rows_c != [
        i.row["text"] for i in mix.stream(other, resolve_parts(other, "sft")) if i.use and i.part.index == 2
    ]


def test_prompt_sources_mix_for_grpo(tiny_model, tmp_path):
    """grpo reads prompt rows of several sources, each source's system turn first, its columns kept."""
    math = write_jsonl(tmp_path / "math.jsonl", [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(30)])
    chat = write_jsonl(
        tmp_path / "chat.jsonl",
        [{"prompt": [{"role": "user", "content": f"Say {i}."}], "answer": str(i)} for i in range(30)],
    )
    cfg = DataConfig(
        sources=[{"path": math}, {"path": chat, "weight": 0.5, "system_prompt": "Be terse."}],
        eval_ratio=0.2,
        seq_len=64,
    )
    prepared = prepare(cfg, tiny_model, str(tmp_path / "out"), objective="grpo", reward_columns=["answer"])
    first, second = prepared.report.mix
    assert second["train_examples"] == first["target_rows"] // 2 and first["train_examples"] == first["target_rows"]
    train = storage.read_bytes(storage.join(prepared.url, prepared.shards["train"][0])).decode().splitlines()
    rows = [json.loads(line) for line in train]
    chats = [r for r in rows if isinstance(r["prompt"], list)]
    assert len(chats) == second["train_examples"] and all(r["prompt"][0]["content"] == "Be terse." for r in chats)
    assert all("answer" in r["columns"] for r in rows)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"sources": [{"path": "a.jsonl", "weight": 0}]}, "data.sources.0.weight = 0: Input should be greater than 0"),
        (
            {"sources": [{"path": "a.jsonl", "weight": 1, "epochs": 2}]},
            "weight = 1.0, epochs = 2.0: give one of weight, rows and epochs per source",
        ),
        ({"sources": [{"path": "a.jsonl", "rows": 0}]}, "data.sources.0.rows = 0: Input should be greater than or"),
        ({"sources": [{"path": "a.jsonl", "epochs": 5000}]}, "data.sources.0.epochs = 5000: Input should be less than"),
        ({}, "neither data.path nor data.sources is set"),
        ({"path": "x.jsonl", "sources": [{"path": "a.jsonl"}]}, "data.path = 'x.jsonl' and data.sources are both set"),
        (
            {"sources": [{"path": "dir/a.jsonl"}, {"path": "other/a.jsonl"}]},
            "the name(s) ['a'] are given to more than one source; set each one's `name`",
        ),
    ],
)
def test_bad_mixes_name_the_field(data, message):
    with pytest.raises(ConfigError) as err:
        build_config({"base": "ladle://tiny-llama", "data": data}, [])
    assert message in str(err.value)


def test_sources_that_cannot_be_read_together_name_the_source(tiny_model, tmp_path):
    chats = write_jsonl(tmp_path / "chats.jsonl", [{"instruction": "a", "output": "b"}] * 4)
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "p", "chosen": "c", "rejected": "r"}] * 4)
    with pytest.raises(LadleError, match=r"data.sources\[1\].path = '.*pairs.jsonl': rows are preference pairs"):
        resolve_parts(DataConfig(sources=[{"path": chats}, {"path": pairs}]), "sft")
    with pytest.raises(LadleError, match=r"data.sources\[0\].path = '.*chats.jsonl': training.objective = dpo needs"):
        resolve_parts(DataConfig(sources=[{"path": chats}, {"path": pairs}]), "dpo")
    with pytest.raises(LadleError, match=r"data.sources\[1\].path = '.*nope.jsonl': no such file"):
        resolve_parts(DataConfig(sources=[{"path": chats}, {"path": str(tmp_path / "nope.jsonl")}]), "sft")
    (tmp_path / "blank.jsonl").write_text("\n\n")
    blank = str(tmp_path / "blank.jsonl")
    with pytest.raises(LadleError, match=r"data.sources\[1\].path = '.*blank.jsonl': no training rows \(0 record"):
        resolve_parts(DataConfig(sources=[{"path": chats}, {"path": blank}]), "sft")


def test_data_path_on_the_command_line_replaces_the_sources():
    cfg = build_config(
        {"base": "ladle://tiny-llama", "data": {"sources": [{"path": "a.jsonl"}, {"path": "b.jsonl"}]}},
        ["data.path=mine.jsonl"],
    )
    assert cfg.data.path == "mine.jsonl" and cfg.data.sources is None
    assert "data.sources ['a.jsonl', 'b.jsonl'] are not used" in " ".join(cfg.notes)


def test_data_sources_on_the_command_line_replace_a_recipes_one_path():
    """The natural command over a recipe that has data.path: the sources given win, the report says the recipe's
    path (and its held-out file, which belonged to that data) are not used."""
    recipe = {"base": "ladle://tiny-llama", "data": {"path": "ladle://demo-alpaca", "eval_path": "held.jsonl"}}
    cfg = build_config(recipe, ["data.sources=[{path: a.jsonl, weight: 2}, {path: b.jsonl}]"])
    assert cfg.data.path is None and [s.path for s in cfg.data.sources] == ["a.jsonl", "b.jsonl"]
    said = " ".join(cfg.notes)
    assert "data.path = 'ladle://demo-alpaca' is not used" in said and "data.eval_path = 'held.jsonl'" in said
    kept = build_config(recipe, ["data.sources=[{path: a.jsonl}]", "data.eval_path=mine.jsonl"])
    assert kept.data.eval_path == "mine.jsonl"
