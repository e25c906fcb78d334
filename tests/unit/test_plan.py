import shlex

import pytest

from ladle.config import build_config
from ladle.errors import ConfigError
from ladle.plan import make_plan
from ladle.topology import probe
from tests.unit.test_topology import A100_X8, T4_X2

MINIMAL = {"base": "ladle://tiny-llama", "data": {"path": "ladle://demo-alpaca"}}
CPU = probe(env={}, query_output="")
A100 = probe(env={}, query_output=A100_X8)
T4 = probe(env={}, query_output=T4_X2)


def plan_for(topo, *overrides, gpus=None):
    return make_plan(build_config(MINIMAL, list(overrides), gpus), topo, "my.yaml")


def test_auto_on_cpu_plans_gloo_processes_and_warns():
    plan = plan_for(CPU)
    assert (plan.device, plan.backend, plan.world_size, plan.strategy) == ("cpu", "gloo", 2, "ddp")
    assert any("--gpus auto found no GPU" in w for w in plan.warnings)
    assert any(r.startswith("strategy ddp:") for r in plan.reasons)


def test_explicit_gpus_on_cpu_host_prints_corrected_command():
    with pytest.raises(ConfigError) as info:
        plan_for(CPU, gpus="2")
    assert "parallelism.gpus = 2: this host has no CUDA GPU" in str(info.value)
    assert "ladle run my.yaml --gpus auto" in str(info.value)


def test_more_gpus_than_visible():
    with pytest.raises(ConfigError, match=r"parallelism.gpus = 8: this host has 2 visible GPU\(s\).*--gpus 2"):
        plan_for(T4, gpus="8")


def test_gpu_auto_uses_all_and_picks_dtype_by_capability():
    plan = plan_for(A100)
    assert (plan.device, plan.backend, plan.world_size, plan.dtype) == ("cuda", "nccl", 8, "bfloat16")
    assert plan_for(T4).dtype == "float16"


def test_global_batch_derives_accumulation():
    plan = plan_for(CPU, "training.micro_batch_size=2", "training.global_batch_size=16")
    assert plan.gradient_accumulation == 4
    assert any("gradient accumulation 4" in r for r in plan.reasons)


def test_every_problem_at_once():
    with pytest.raises(ConfigError) as info:
        plan_for(CPU, "training.global_batch_size=10", "serve.backend=mii", "training.quantization.mode=nf4", gpus="4")
    problems = info.value.problems
    assert len(problems) == 4
    assert any(p.startswith("training.global_batch_size = 10: not a multiple") and "Use 8 or 16" in p for p in problems)
    assert any(p.startswith("serve.backend = mii: DeepSpeed-MII has no CPU path") for p in problems)
    assert any(p.startswith("training.quantization.mode = nf4") for p in problems)


def test_explicit_strategy_is_an_override():
    plan = plan_for(CPU, "parallelism.strategy=ddp")
    assert plan.overrides == ["parallelism.strategy = ddp (explicit)"]


def test_launch_argv_is_a_list_and_keeps_metacharacters_verbatim():
    plan = plan_for(CPU)
    nasty = "/tmp/a b;rm -rf $HOME`x`/spec.json"
    argv = plan.launcher_argv([nasty], port=1234)
    assert argv[-1] == nasty
    assert argv[argv.index("--num_processes") + 1] == "2"
    assert "--multi_gpu" in argv  # two CPU processes need torchrun, not --cpu
    assert shlex.split(plan.launch_command([nasty], port=1234))[-1] == nasty


def test_memory_output_rejected():
    with pytest.raises(ConfigError, match=r"output = memory://x: training runs in separate processes"):
        plan_for(CPU, "output=memory://x")


def test_fsdp2_is_selectable_and_carries_its_options():
    plan = plan_for(CPU, "parallelism.strategy=fsdp2", "parallelism.fsdp2.reshard_after_forward=false")
    assert plan.strategy == "fsdp2"
    assert plan.strategy_options == {"reshard_after_forward": False, "cpu_offload": False}
    assert "--multi_gpu" in plan.launcher_argv(["spec.json"])  # fully_shard is applied by ladle, not accelerate's plugin


def test_fsdp2_cpu_offload_needs_cuda():
    with pytest.raises(ConfigError, match=r"parallelism.fsdp2.cpu_offload = true: .*Set parallelism.fsdp2.cpu_offload=false"):
        plan_for(CPU, "parallelism.strategy=fsdp2", "parallelism.fsdp2.cpu_offload=true")


def test_unknown_strategy_lists_the_choices():
    with pytest.raises(ConfigError, match=r"parallelism.strategy = \"zero9\": Input should be 'auto', 'ddp' or 'fsdp2'"):
        plan_for(CPU, "parallelism.strategy=zero9")
