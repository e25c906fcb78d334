"""A run's inputs are resolved once: the flow's first task resolves the base, fingerprints the data and finds the
tracking server, and no later stage does any of it again (they take ``RunInputs`` or the values in it)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from prefect import flow

from ladle.config import build_config
from ladle.plan.inputs import RunInputs, resolve_inputs
from ladle.tasks.prepare import prepare_cached

ROOT = Path(__file__).resolve().parents[2]
RESOLVERS = {"resolve_base", "fingerprint", "check_inputs", "resolve_inputs", "tracking_uri", "local_model_config"}
"""The calls that read the world outside a config: the base's files, the data's contents, the tracking server."""


def calls(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in RESOLVERS:
                found.add(f"{path.relative_to(ROOT)}:{node.lineno} {name}")
    return found


def test_only_the_inputs_task_resolves_inputs_in_the_flow_and_its_tasks():
    files = sorted((ROOT / "tasks").glob("*.py")) + [ROOT / "flows" / "finetune.py"]
    found = {hit for path in files for hit in calls(path)}
    assert {hit.split(":")[0] for hit in found} == {"tasks/inputs.py"}, found


def test_the_prepare_stage_takes_the_fingerprint_it_is_handed(prefect_harness, tiny_model, tmp_path, monkeypatch):
    data = tmp_path / "d.jsonl"
    data.write_text('{"instruction": "Add 1 and 2.", "output": "3"}\n' * 30)
    cfg = build_config({"base": "ladle://tiny-llama", "data": {"path": str(data)}, "output": str(tmp_path)}, [])
    inputs = resolve_inputs(cfg)
    assert isinstance(inputs, RunInputs) and inputs.base.resolve() == tiny_model.resolve()
    assert inputs.registered_model == cfg.name and inputs.dataset_url.endswith(inputs.data_fingerprint)

    def refuse(*args, **kwargs):
        raise AssertionError("the data was fingerprinted again")

    monkeypatch.setattr("ladle.data.prepare.fingerprint", refuse)
    monkeypatch.setattr("ladle.assets.resolve_base", refuse)

    @flow
    def prepare_only():
        return prepare_cached(cfg.data, inputs)

    prepared = prepare_only()
    assert prepared.fingerprint == inputs.data_fingerprint and prepared.url == inputs.dataset_url


def test_bad_inputs_fail_the_first_task_naming_the_field(tmp_path):
    cfg = build_config({"base": str(tmp_path / "nowhere"), "data": {"path": "ladle://demo-alpaca"}}, [])
    from ladle.errors import LadleError

    with pytest.raises(LadleError, match="base = .*no such folder"):
        resolve_inputs(cfg)
