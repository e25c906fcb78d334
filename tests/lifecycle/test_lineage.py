"""The retraining fingerprint: the same inputs give the same one; new data, a new base with the same tokenizer,
or a changed learning rate give another; settings that only change how a run proceeds do not."""

from __future__ import annotations

import shutil

from ladle.assets import resolve_base
from ladle.config import build_config
from ladle.lifecycle.lineage import run_fingerprint
from tests.helpers import fresh_registry

MINIMAL = {"base": "ladle://tiny-llama", "data": {"path": "ladle://demo-alpaca"}}


def test_what_changes_the_trained_model_changes_the_fingerprint(tmp_path):
    base = resolve_base("ladle://tiny-llama")
    cfg = build_config(MINIMAL, [])
    same = run_fingerprint(cfg, "data-1", base)
    assert run_fingerprint(build_config(MINIMAL, []), "data-1", base) == same
    assert run_fingerprint(cfg, "data-2", base) != same
    assert run_fingerprint(build_config(MINIMAL, ["training.lr=1e-3"]), "data-1", base) != same
    assert run_fingerprint(build_config(MINIMAL, ["training.lora.r=4"]), "data-1", base) != same
    for how in ("training.checkpoint_every=7", "training.eval_every=3", "training.save_shard_mib=64"):
        assert run_fingerprint(build_config(MINIMAL, [how]), "data-1", base) == same, how

    other = tmp_path / "base"  # the same tokenizer and config, other weights
    shutil.copytree(base, other)
    weights = next(other.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert run_fingerprint(cfg, "data-1", other) != same


def test_the_scheduled_run_says_what_changed_since_the_champion_and_model_list_shows_it(tmp_path, tiny_model):
    """The nightly decision (``flows.finetune.data_unchanged``) against a real registry: unchanged skips; a new
    learning rate, or a base with other weights (same tokenizer and config), trains and says which; the
    decision kept on the registered model is what `ladle model list` prints."""
    import json

    from flows.finetune import data_unchanged, record_check
    from ladle.lifecycle import lineage, promote
    from ladle.plan.inputs import resolve_inputs
    from tests.helpers import run_cli

    uri = fresh_registry(tmp_path)
    base = tmp_path / "base"
    shutil.copytree(tiny_model, base)
    settings = {"base": str(base), "data": {"path": "ladle://demo-alpaca"}, "name": "nightly"}
    cfg = build_config(settings, [f"tracking.uri={uri}"])
    first = resolve_inputs(cfg)
    tags = {lineage.TAG: first.fingerprint, lineage.PARTS_TAG: json.dumps(first.lineage)}
    v1 = promote.register(uri, "nightly", str(tiny_model), None, tags)
    assert data_unchanged(first)[1] == "no champion yet"
    promote.promote(uri, "nightly", v1.version, "first")

    same, why = data_unchanged(resolve_inputs(cfg))
    assert same.version == "1" and why == "data, base and training unchanged since version 1"
    same, why = data_unchanged(resolve_inputs(build_config(settings, [f"tracking.uri={uri}", "training.lr=1e-3"])))
    assert same is None and why == "changed since champion v1: training.lr 0.0002 -> 0.001"

    weights = next(base.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    now = resolve_inputs(cfg)
    same, why = data_unchanged(now)
    assert same is None and why == "changed since champion v1: base weights"
    assert now.fingerprint != first.fingerprint and now.data_fingerprint == first.data_fingerprint

    record_check(now, "run-42", "trained", why)
    listed = run_cli("model", "list", "nightly", "--tracking-uri", uri, "--json")
    check = json.loads(listed.stdout.splitlines()[-1])["last_retraining_check"]
    assert (check["decision"], check["reason"], check["flow_run_id"]) == ("trained", why, "run-42")
    shown = " ".join(run_cli("model", "list", "nightly", "--tracking-uri", uri).stderr.split())  # rich: stderr
    assert "last scheduled run: trained at" in shown and "base weights" in shown


def test_the_scheduled_run_of_one_adapter_of_a_fleet_decides_for_that_adapter_alone(tmp_path, tiny_model):
    """Two adapters of one base (``promote.merge: false``), each its own registered model and recipe: new data for
    ``support`` makes its scheduled run train, while ``billing``'s run, on the same base and the same store, skips
    (its inputs unchanged), and each decision is recorded on its own registered model."""
    import json

    from flows.finetune import data_unchanged, record_check
    from ladle.lifecycle import lineage, promote, retraining
    from ladle.plan.inputs import resolve_inputs

    uri = fresh_registry(tmp_path)
    rows = tmp_path / "support.jsonl"
    rows.write_text(json.dumps({"instruction": "say hi", "output": "hi"}) + "\n")

    def adapter(name: str, data: str):
        settings = {"base": str(tiny_model), "data": {"path": data}, "name": name}
        return resolve_inputs(build_config(settings, [f"tracking.uri={uri}", "promote.merge=false"]))

    for name, data in (("support", str(rows)), ("billing", "ladle://demo-alpaca")):
        first = adapter(name, data)
        tags = {"ladle.kind": "adapter", lineage.TAG: first.fingerprint, lineage.PARTS_TAG: json.dumps(first.lineage)}
        promote.promote(uri, name, promote.register(uri, name, str(tmp_path), None, tags).version, "first")
    rows.write_text(rows.read_text() + json.dumps({"instruction": "say bye", "output": "bye"}) + "\n")

    support, billing = adapter("support", str(rows)), adapter("billing", "ladle://demo-alpaca")
    same, why = data_unchanged(support)
    assert same is None and why.startswith("changed since champion v1: data")
    kept, unchanged = data_unchanged(billing)
    assert kept.version == "1" and unchanged == "data, base and training unchanged since version 1"
    record_check(support, "run-s", "trained", why)
    record_check(billing, "run-b", "skipped", unchanged)
    assert retraining.retraining_check(uri, "support")["decision"] == "trained"
    assert retraining.retraining_check(uri, "billing")["decision"] == "skipped"
