"""Captured traffic into training rows (``ladle data from-traffic``): the server's own writer makes the files, the
curation reads them back into sft, dpo, kto and grpo rows, without duplicates (of each other and of the recipe's
data) or prompts that overlap the evaluation set, and the rows prepare as the recipe's data.sources entry."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ladle.cli.main import app
from ladle.config import load_config
from ladle.data import traffic
from ladle.errors import LadleError
from ladle.serve.capture import CaptureSettings, Recorder

RECIPE = str(Path(__file__).parents[2] / "recipes" / "tiny-cpu.yaml")


def chat(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}]


def record(prompt, answer: str, finish: str = "stop", route: str = "chat") -> dict:
    request = {"messages": chat(prompt)} if route == "chat" else {"prompt": prompt}
    return {
        "at": "2026-12-07T10:00:00.000+00:00",
        "route": route,
        "request": {**request, "temperature": 0.0, "max_tokens": 16},
        "answer": {"content": answer},
        "finish_reason": finish,
        "prompt_tokens": 5,
        "completion_tokens": 3,
        "latency_s": 0.01,
    }


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    root = tmp_path_factory.mktemp("traffic")
    cfg = load_config(RECIPE, [f"output={root / 'runs'}"])
    known = traffic.recipe_data(cfg)
    return cfg, root, known


def held_out_and_trained(known: traffic.RecipeData) -> tuple[str, str, str]:
    """A held-out prompt, and a training row's prompt and answer, of the demo data (as the recipe splits it)."""
    from ladle.assets.demo import demo_rows

    held = known.eval_texts[0]
    for row in demo_rows():
        prompt = f"{row['instruction']}\n{row['input']}"
        key = traffic.conversation_key(chat(prompt), "sft", json.dumps({"role": "assistant", "content": row["output"]}))
        if key in known.keys["sft"] and prompt not in known.eval_texts:
            return held, prompt, row["output"]
    raise AssertionError("no training row found")


def write_traffic(store: Path, known: traffic.RecipeData) -> dict:
    """What a served model heard over a day, written by the server's own recorder, with a crash's leftovers beside
    it; returns the cases."""
    cases = write_traffic_to(str(store), known)
    # What a crash or another tool may leave: a writer's temporary file and a torn line in a whole file.
    day = next((store / "captures").iterdir())
    part = next(day.rglob("part-*.jsonl"))
    (part.parent / ".part-tmp-123.jsonl").write_text('{"torn": ')
    part.write_text(part.read_text() + '{"id": "chatcmpl-torn", "rou\n')
    (store / "feedback" / day.name).mkdir(parents=True, exist_ok=True)
    (store / "feedback" / day.name / "part-h-1-1765100000000-000001.jsonl").write_text(
        json.dumps({"response_id": "chatcmpl-elsewhere", "value": True, "at": "2026-12-07T11:00:00"}) + "\n"
    )
    return cases


def write_traffic_to(url: str, known: traffic.RecipeData) -> dict:
    """The day's requests and feedback, through the server's own recorder, into ``url`` (a folder or an fsspec URL)."""
    held, trained_prompt, trained_answer = held_out_and_trained(known)
    rec = Recorder(CaptureSettings(enabled=True, flush_s=0.1), url, "tiny-cpu", "3")
    cases = {
        "liked": (record("Name a warm colour.", "red"), {"value": True}),
        "liked_again": (record("Name a warm colour.", "red"), {"value": True}),  # a duplicate of the first
        "corrected": (record("Name a cold colour.", "red"), {"value": False, "correction": "blue"}),
        "pair_good": (record("Name a dark colour.", "black"), {"value": 0.9}),
        "pair_bad": (record("Name a dark colour.", "white"), {"value": 0.1}),
        "unjudged": (record("Name any colour.", "green"), None),
        "cut": (record("List every colour.", "red blue green", finish="length"), {"value": True}),
        "held_out": (record(held, "wrong"), {"value": False, "correction": "right"}),
        "in_recipe": (record(trained_prompt, trained_answer), {"value": True}),
        "secret": (record("my password: hunter2hunter2 ok?", "noted"), {"value": True}),
        "text": (record("Once upon a time", " there", route="completions"), {"value": True}),
    }
    for name, (rec_, _) in cases.items():
        assert rec.record(f"chatcmpl-{name}", rec_)
    for name, (_, said) in cases.items():
        if said is not None:
            rec.feedback({"response_id": f"chatcmpl-{name}", "name": "user_feedback", **said})
    rec.close()
    assert rec.stopped is None
    return cases


def rows(report, kind: str) -> list[dict]:
    path = report.files.get(kind)
    return [json.loads(line) for line in Path(path).read_text().splitlines()] if path else []


def test_traffic_becomes_rows_of_every_kind_without_duplicates_or_eval_overlap(recipe):
    cfg, root, known = recipe
    store = root / "traffic"
    write_traffic(store, known)
    report = traffic.curate(cfg, str(store))

    assert report.requests == 11 and report.with_feedback == 10
    assert report.feedback == 11 and report.feedback_unmatched == 1
    assert report.dropped["unreadable line"] == 1
    assert report.dropped["sft: a good answer cut at max_tokens"] == 1
    assert report.dropped["sft: repeats another traffic row"] == 1
    assert report.dropped["sft: already in the recipe's data"] == 1
    assert report.dropped["sft: prompt overlaps the evaluation set"] == 1
    assert report.overlap_examples == [known.eval_texts[0]]

    sft = rows(report, "sft")
    answers = {r["messages"][0]["content"]: r["messages"][-1]["content"] for r in sft}
    assert answers == {
        "Name a warm colour.": "red",
        "Name a cold colour.": "blue",  # the correction, not the answer given
        "Name a dark colour.": "black",  # 0.9 >= retrain.good_score
        "my [redacted:secret] ok?": "noted",  # redacted before it was ever written
    }
    dpo = {
        r["prompt"][0]["content"]: (r["chosen"][0]["content"], r["rejected"][0]["content"]) for r in rows(report, "dpo")
    }
    assert dpo == {"Name a cold colour.": ("blue", "red"), "Name a dark colour.": ("black", "white")}
    kto = sorted((r["prompt"][0]["content"], r["completion"][0]["content"], r["label"]) for r in rows(report, "kto"))
    assert ("Name a cold colour.", "blue", True) in kto and ("Name a cold colour.", "red", False) in kto
    assert ("Name a dark colour.", "white", False) in kto and ("List every colour.", "red blue green", True) in kto
    grpo = [r["prompt"] for r in rows(report, "grpo")]
    assert chat("Name any colour.") in grpo and "Once upon a time" in grpo  # every prompt, judged or not
    assert grpo.count(chat("Name a warm colour.")) == 1
    assert all(known.eval_texts[0] not in json.dumps(r) for kind in traffic.KINDS for r in rows(report, kind))

    # The recipe's objective (sft) as a data.sources entry, and it prepares beside the recipe's own data.
    assert report.sources == [{"path": report.files["sft"], "name": "traffic-sft", "format": "messages", "epochs": 2.0}]
    again = traffic.curate(cfg, str(store))
    assert again.folder == report.folder  # the same traffic: the same folder, so the same run fingerprint
    # Rows are new after a time when their request or their feedback is newer (the champion's window's end).
    assert traffic.curate(cfg, str(store), new_after=report.last_at).new_rows == dict.fromkeys(traffic.KINDS, 0)
    assert traffic.curate(cfg, str(store), new_after="2026-12-07T09:00:00").new_rows["sft"] == 4
    assert traffic.count_new(report.folder, "sft", report.last_at) == 0  # what a scheduled run weighs
    assert traffic.count_new(report.folder, "sft", None) == 4 and traffic.count_new(report.folder, "dpo", None) == 2


def test_from_traffic_cli_and_what_it_refuses(recipe, tmp_path):
    cfg, root, known = recipe
    store = tmp_path / "traffic"
    write_traffic(store, known)
    runner = CliRunner()
    base = ["data", "from-traffic", RECIPE, "--set", f"output={tmp_path / 'runs'}", "--traffic", str(store)]
    result = runner.invoke(app, [*base, "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["rows"]["sft"] == 4 and report["sources"][0]["name"] == "traffic-sft"
    result = runner.invoke(app, base)
    assert result.exit_code == 0 and "traffic-sft" in result.output and "epochs: 2.0" in result.output

    result = runner.invoke(app, [*base, "--model", "other"])
    assert result.exit_code == 2 and "no captured request" in result.output and "for model other" in result.output
    result = runner.invoke(app, [*base, "--since", "2026-13-01"])
    assert result.exit_code == 2 and "--since = '2026-13-01': not a day" in result.output
    result = runner.invoke(app, [*base, "--since", "2999-01-01"])
    assert result.exit_code == 2 and "from 2999-01-01" in result.output
    with pytest.raises(LadleError, match="no captured request"):
        traffic.curate(cfg, str(tmp_path / "nothing-here"))


def test_a_run_learning_from_traffic_prepares_it_beside_the_recipes_data(recipe, tiny_model, tmp_path):
    """``retrain.from_traffic``: the recipe's ``data.path`` becomes the first of two sources, the traffic rows the
    second (their epochs), and the prepare stage reads both in their own formats."""
    from ladle.data.prepare import prepare
    from ladle.tasks.traffic import traffic_tags, with_traffic

    cfg, _, known = recipe
    store = tmp_path / "traffic"
    write_traffic(store, known)
    report = traffic.curate(cfg, str(store))
    learning = with_traffic(cfg, report)
    assert learning.data.path is None
    assert [(s.path, s.format, s.epochs) for s in learning.data.sources] == [
        ("ladle://demo-alpaca", None, None),
        (report.files["sft"], "messages", 2.0),
    ]
    prepared = prepare(learning.data, tiny_model, str(tmp_path / "out"), objective="sft")
    mix = {m["name"]: m for m in prepared.report.mix}
    assert mix["traffic-sft"]["training_records"] + mix["traffic-sft"]["held_out"] == 4
    assert mix["traffic-sft"]["dropped"] == 0 and mix["demo-alpaca"]["dropped"] == 0
    # The thumbs as unpaired preferences, trained by training.objective: kto in TRL's shape.
    kto = cfg.data.model_copy(update={"path": report.files["kto"], "format": "kto", "eval_ratio": 0.0})
    thumbs = prepare(kto, tiny_model, str(tmp_path / "kto"), objective="kto")
    assert thumbs.report.rows_used == report.rows["kto"] and not thumbs.report.dropped
    tags = traffic_tags(report)
    assert tags["ladle.traffic.last_at"] == report.last_at and tags["ladle.traffic.requests"] == "11"
    assert with_traffic(cfg, traffic.curate(cfg, str(tmp_path / "none"), empty_ok=True)) is cfg  # nothing to add


def test_traffic_in_s3_is_captured_curated_and_replayed_from_the_store(recipe, s3_server, monkeypatch):
    """The capture, the curation and the shadow replay's reading of the newest requests, on an object store (a
    moto S3 server on 127.0.0.1), as on a local folder."""
    from ladle.lifecycle.shadow import last_requests
    from ladle.platform import storage

    for key, value in s3_server.items():
        monkeypatch.setenv(key, value)
    cfg, _, known = recipe
    cfg = cfg.model_copy(update={"output": "s3://ladle/flywheel"})
    url = "s3://ladle/flywheel/traffic"
    write_traffic_to(url, known)
    report = traffic.curate(cfg, url)
    assert report.requests == 11 and report.rows["sft"] == 4
    assert report.folder.startswith("s3://ladle/flywheel/traffic-data/")
    rows_text = storage.read_bytes(report.files["sft"]).decode()
    assert "Name a cold colour." in rows_text and "hunter2" not in rows_text
    taken = last_requests(url, "tiny-cpu", "3", 3)
    assert [r["id"] for r, _ in taken] == ["chatcmpl-held_out", "chatcmpl-in_recipe", "chatcmpl-secret"]
    assert taken[0][1]["correction"] == "right"  # with its latest feedback
