"""Preference tuning in the planner and the config: the paired row counted in memory, the reference decided in
GiB, strategies that cannot sum a side's log-probability refused with the reason (and never chosen by auto), and
settings that do not fit together refused naming the field, the value and the fix."""

from __future__ import annotations

import dataclasses

import pytest

from ladle.config import build_config
from ladle.errors import ConfigError, LadleError
from ladle.machine.topology import probe, probe_file
from ladle.plan.inputs import local_model_config
from ladle.plan.planner import make_plan
from tests.helpers import NVSWITCH_8

CPU = probe(env={}, query_output="")
PAIRS = {
    "base": "ladle://tiny-llama",
    "data": {"path": "ladle://demo-preference", "seq_len": 128},
    "training": {"objective": "dpo"},
}


def plan(*overrides: str, topo=CPU, base: str | None = None):
    raw = dict(PAIRS, base=base) if base else PAIRS
    cfg = build_config(raw, list(overrides))
    return make_plan(cfg, topo, "my.yaml", model=local_model_config(cfg))


@pytest.fixture(scope="module")
def h100x8(tmp_path_factory):
    path = tmp_path_factory.mktemp("topo") / "nvswitch"
    path.write_text(NVSWITCH_8)
    return probe_file(str(path), env={}, gpu_memory_gib=80)


def test_a_pair_row_is_sized_as_two_sides(tiny_model):
    from ladle.plan.memory import sizing_job
    from ladle.strategies import Target

    cfg = build_config(PAIRS, [])
    sft = build_config(dict(PAIRS, training={}), ["data.seq_len=256"])
    target = Target("cpu", 2, 1, "float32")
    job = sizing_job(cfg, local_model_config(cfg), target, 4)
    assert job.seq_len == 256
    assert dataclasses.asdict(job) == dataclasses.asdict(sizing_job(sft, local_model_config(sft), target, 4))


def test_the_reference_is_decided_in_gib_and_reported(tiny_model, h100x8):
    made = plan()
    assert made.reference == "precomputed"
    (why,) = [r for r in made.reasons if r.startswith("reference precomputed (auto)")]
    assert "no reference weights during the steps" in why and "one row per pair (2 x data.seq_len tokens)" in why
    full = plan("training.lora.enabled=false", topo=h100x8, base="ladle://models/llama-3.1-8b")
    (why,) = [r for r in full.reasons if r.startswith("reference precomputed")]
    assert "a frozen reference copy sharded like the policy would hold" in why and " GiB/rank more" in why
    assert plan("training.preference.reference=adapters_off").reference == "adapters_off"
    assert plan("training.preference.loss=simpo").reference == "none"
    assert plan(topo=h100x8, base="ladle://models/llama-3.1-8b").strategy in ("ddp", "zero1", "zero2", "zero3", "fsdp2")


@pytest.mark.parametrize(
    ("overrides", "why"),
    [
        (["parallelism.strategy=pipeline", "parallelism.pipeline.allow_cpu=true"], "pipeline stages compute the loss"),
        (["parallelism.dims.sp=2", "parallelism.cpu_processes=4"], "sequence parallelism splits every row"),
    ],
)
def test_strategies_that_cannot_sum_a_side_are_refused(tiny_model, overrides, why):
    with pytest.raises(ConfigError) as info:
        plan(*overrides)
    text = str(info.value)
    assert "training.objective = dpo with parallelism.strategy = " in text and why in text
    assert "Use ddp, zero1, zero2, zero3, zero++ or fsdp2" in text


def test_auto_never_chooses_a_layout_that_splits_a_row(h100x8):
    """The long-context recipe's base at 64k tokens per side: SFT would split sequences (sp); pairs may not, so
    the plan says nothing fits rather than planning sp."""
    long = ["data.seq_len=65536", "training.micro_batch_size=1", "parallelism.gpus=8"]
    with pytest.raises(ConfigError) as info:
        plan(*long, topo=h100x8, base="ladle://models/llama-3.1-70b")
    candidates = info.value.details["candidates"]
    assert candidates and "sp=" not in str(candidates)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["training.preference.label_smoothing=0.1"], "training.preference.label_smoothing = 0.1: the sigmoid loss"),
        (
            ["training.preference.reference=adapters_off", "training.lora.enabled=false"],
            "training.preference.reference = adapters_off with training.lora.enabled = false",
        ),
        (["training.preference.loss=simpo", "training.preference.reference=precomputed"], "SimPO is reference-free"),
        (["training.objective=sft", "eval.metric=preference_accuracy"], "only preference pairs have it"),
        (["training.preference.loss=kto"], "training.preference.loss"),
    ],
)
def test_settings_that_do_not_fit_are_refused_by_name(overrides, message):
    with pytest.raises(LadleError) as info:
        build_config(PAIRS, overrides)
    assert message in str(info.value)
