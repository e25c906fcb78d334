"""``base: models:/NAME@ALIAS`` (or ``models:/NAME/VERSION``): a run starts from a version in the registry — a
preference-tuning run from the supervised champion — resolved once, recorded with the run, and covered by the
nightly fingerprint (a new champion under the alias is a new base)."""

from __future__ import annotations

import shutil

import pytest

from ladle.config import build_config
from ladle.errors import LadleError
from ladle.lifecycle import promote
from ladle.plan.inputs import resolve_inputs
from tests.helpers import fresh_registry


@pytest.fixture
def registry(tmp_path, tiny_model):
    uri = fresh_registry(tmp_path)
    other = tmp_path / "v2"
    shutil.copytree(tiny_model, other)
    weights = next(other.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF  # other weights, same config and tokenizer
    weights.write_bytes(bytes(data))
    v1 = promote.register(uri, "sft", str(tiny_model), None, {})
    v2 = promote.register(uri, "sft", str(other), None, {})
    promote.promote(uri, "sft", v1.version, "first")
    return uri, v1, v2


def config(uri: str, base: str):
    pairs = {"path": "ladle://demo-preference", "seq_len": 64}
    return build_config(
        {"base": base, "data": pairs, "training": {"objective": "dpo"}, "name": "dpo"}, [f"tracking.uri={uri}"]
    )


def test_the_champion_is_the_base_and_the_run_records_which(registry, tiny_model):
    uri, v1, v2 = registry
    inputs = resolve_inputs(config(uri, "models:/sft@champion"))
    assert inputs.base.resolve() == tiny_model.resolve() and inputs.base_version == "sft v1"
    pinned = resolve_inputs(config(uri, "models:/sft/2"))
    assert pinned.base_version == "sft v2" and pinned.base.name == "v2"
    assert pinned.fingerprint != inputs.fingerprint  # other weights: the nightly run would train
    promote.promote(uri, "sft", v2.version, "better")
    moved = resolve_inputs(config(uri, "models:/sft@champion"))
    assert moved.base_version == "sft v2" and moved.fingerprint == pinned.fingerprint


@pytest.mark.parametrize(
    ("base", "message"),
    [
        ("models:/sft@nobody", "has no version aliased 'nobody' of model 'sft'"),
        ("models:/sft/9", "has no version 9 of model 'sft'"),
        ("models:/missing@champion", "of model 'missing' (or no such model)"),
        ("models:/sft", "a registered model is models:/NAME@ALIAS"),
    ],
)
def test_a_base_the_registry_does_not_hold_is_one_clear_error(registry, base, message):
    uri, _, _ = registry
    with pytest.raises(LadleError) as info:
        resolve_inputs(config(uri, base))
    assert f"base = {base!r}" in str(info.value) and message in str(info.value)
