"""Two machines x one process each, rendezvous on 127.0.0.1: node 0 through the train stage, node 1 through `ladle launch`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ladle.config import build_config
from ladle.errors import ConfigError
from ladle.machine.topology import probe
from ladle.plan.planner import make_plan
from ladle.platform.processes import stop_process
from ladle.train.run import free_port, launch
from tests.helpers import train_spec

pytestmark = pytest.mark.pipeline
CPU = probe(env={}, query_output="")


def config(**parallelism):
    return build_config(
        {
            "base": "ladle://tiny-llama",
            "data": {"path": "ladle://demo-alpaca", "seq_len": 128},
            "parallelism": parallelism,
            "training": {"max_steps": 4, "lr": 3e-3, "micro_batch_size": 2},
        },
        [],
    )


@pytest.fixture(scope="module")
def single_node(tmp_path_factory, tiny_model):
    """One machine, 2 processes, global batch 4: the losses every multi-node layout must reproduce."""
    spec = train_spec(config(cpu_processes=2), tmp_path_factory.mktemp("single"), "single")
    return spec.dataset, launch(spec)


def test_two_nodes_on_loopback_match_one_node_with_two_processes(tmp_path, tiny_model, single_node):
    multi = config(nodes=2, cpu_processes=1, main_port=free_port())
    spec = train_spec(multi, tmp_path, "multi")
    plan = spec.plan
    assert (plan.world_size, plan.num_machines, plan.processes_per_machine) == (2, 2, 1)

    commands: list[str] = []
    node1 = None

    def start_node1(command: str) -> None:
        nonlocal node1
        commands.append(command)
        if command.startswith("waiting for node 1"):
            ladle = str(Path(sys.executable).with_name("ladle"))
            node1 = subprocess.Popen(
                [ladle, "launch", str(tmp_path / "multi" / "spec.json"), "--node-rank", "1"],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )

    try:
        result = launch(spec, on_command=start_node1)
        assert node1 is not None and node1.wait(timeout=120) == 0, node1.stdout.read()[-3000:]
    finally:
        if node1 is not None:
            stop_process(node1)
    assert any(f"ladle launch {tmp_path / 'multi' / 'spec.json'} --node-rank 1" in c for c in commands)
    assert (result.world_size, result.backend) == (2, "gloo")

    assert result.train_losses == pytest.approx(single_node[1].train_losses, abs=1e-5)


def test_multinode_needs_a_fixed_port():
    with pytest.raises(ConfigError, match=r"parallelism.main_port = 0: a 2-node run needs a fixed rendezvous port"):
        make_plan(config(nodes=2), CPU)


# slow: two nodes are proven in make test by the test above, ZeRO++ by tests/train/test_strategies.py; this adds
# ZeRO++'s secondary copy across nodes.
@pytest.mark.slow
def test_zeropp_across_two_nodes_shards_a_secondary_copy_within_each(tmp_path, tiny_model, single_node):
    """2 machines x 2 processes: hpZ defaults to the processes per machine and every parameter gets its
    secondary shard; the losses equal one machine's DDP on the same global batch (hpZ only changes where
    the gathers go)."""
    multi = config(nodes=2, cpu_processes=2, main_port=free_port(), strategy="zero++")
    multi.training.micro_batch_size = 1  # 1 row x 4 ranks: the reference's global batch of 4
    spec = train_spec(multi, tmp_path, "zpp")
    zero = spec.plan.launcher_config["zero_optimization"]
    assert (zero["stage"], zero["zero_hpz_partition_size"], zero["zero_quantized_weights"]) == (3, 2, False)
    assert any("hpZ partition 2: a secondary copy" in r for r in spec.plan.reasons)
    ladle = str(Path(sys.executable).with_name("ladle"))
    node1 = []

    def start_node1(command: str) -> None:
        if command.startswith("waiting for node 1"):
            node1.append(
                subprocess.Popen(
                    [ladle, "launch", str(tmp_path / "zpp" / "spec.json"), "--node-rank", "1"],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )

    try:
        result = launch(spec, on_command=start_node1)
        assert node1 and node1[0].wait(timeout=120) == 0, node1[0].stdout.read()[-3000:]
    finally:
        for proc in node1:
            stop_process(proc)
    assert (result.strategy, result.world_size) == ("zero++", 4)
    assert result.sharding["hpz_partition_size"] == 2
    assert result.sharding["parameter_share"] == pytest.approx(0.25, abs=0.01)
    assert result.train_losses == pytest.approx(single_node[1].train_losses, abs=1e-5)


def test_hpz_must_divide_the_world():
    with pytest.raises(ConfigError, match=r"hpz_partition_size = 3: must divide the world size 4"):
        make_plan(
            build_config(
                {
                    "base": "b",
                    "data": {"path": "d"},
                    "parallelism": {"strategy": "zero_pp", "cpu_processes": 4, "deepspeed": {"hpz_partition_size": 3}},
                },
                [],
            ),
            CPU,
        )
