"""Generated --gpus values and configs: every outcome is a plan or a user error, never anything else."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ladle.config import MAX_GPU_COUNT, build_config, parse_gpus
from ladle.errors import LadleError
from ladle.machine.topology import probe
from ladle.plan.planner import make_plan
from tests.helpers import A100_X8

MINIMAL = {"base": "ladle://tiny-llama", "data": {"path": "ladle://demo-alpaca"}}
HOSTS = [probe(env={}, query_output=""), probe(env={}, query_output=A100_X8)]
PATHS = [
    "parallelism.gpus",
    "parallelism.strategy",
    "parallelism.cpu_processes",
    "parallelism.nodes",
    "parallelism.main_port",
    "training.micro_batch_size",
    "training.global_batch_size",
    "training.lr",
    "training.dtype",
    "training.lora.r",
    "training.lora.target_modules",
    "training.quantization.mode",
    "data.seq_len",
    "data.format",
    "serve.backend",
    "output",
    "parallelism.fsdp2.cpu_offload",
    "nonsense.key",
    "training",
]
VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**6), 10**6),
    st.floats(allow_nan=True),
    st.text(max_size=12),
    st.sampled_from(["auto", "ddp", "fsdp2", "nf4", "mii", "bfloat16", "float16", "[q_proj]", "{}", "memory://x"]),
)


@given(st.one_of(st.text(max_size=8), st.integers(-1000, 1000), st.booleans(), st.floats(), st.none()))
def test_gpus_parse_or_value_error(value):
    try:
        parsed = parse_gpus(value)
    except ValueError:
        return
    assert parsed == "auto" or 1 <= parsed <= MAX_GPU_COUNT


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(PATHS), VALUES), max_size=5),
    st.sampled_from([0, 1]),
    st.one_of(st.none(), st.text(max_size=5)),
)
def test_configs_plan_or_fail_cleanly(overrides, host, gpus):
    sets = [f"{path}={value}" for path, value in overrides]
    try:
        plan = make_plan(build_config(MINIMAL, sets, gpus), HOSTS[host], "c.yaml")
    except LadleError as err:
        assert str(err)  # a message the user can act on
        return
    assert plan.world_size >= 1 and plan.global_batch_size % (plan.micro_batch_size * plan.world_size) == 0
