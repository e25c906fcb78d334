"""The launch environment: ladle's hints never override what the user exported, and never force P2P."""

from __future__ import annotations

from types import SimpleNamespace

from ladle.train.run import worker_env


def spec(device: str, machines: int = 1):
    return SimpleNamespace(
        plan=SimpleNamespace(device=device, processes_per_machine=8, num_machines=machines), tracking_uri=None
    )


def test_nccl_hints_are_defaults_the_user_overrides(monkeypatch):
    monkeypatch.delenv("NCCL_DEBUG", raising=False)
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    env = worker_env(spec("cuda", machines=2))
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1" and env["NCCL_DEBUG"] == "WARN"
    assert env["NCCL_SOCKET_IFNAME"] == "^lo,docker"
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")
    env = worker_env(spec("cuda", machines=2))
    assert env["NCCL_DEBUG"] == "INFO" and env["NCCL_SOCKET_IFNAME"] == "ib0"


def test_peer_to_peer_is_never_forced(monkeypatch):
    for key in ("NCCL_P2P_DISABLE", "NCCL_P2P_LEVEL", "NCCL_P2P_NET_DISABLE"):
        monkeypatch.delenv(key, raising=False)
    env = worker_env(spec("cuda"))
    assert not [k for k in env if k.startswith("NCCL_P2P")]
    assert "NCCL_SOCKET_IFNAME" not in env or env["NCCL_SOCKET_IFNAME"] != "^lo,docker"  # one machine: NCCL decides


def test_cpu_runs_share_the_cores_and_get_no_nccl_hints(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("NCCL_DEBUG", raising=False)
    env = worker_env(
        SimpleNamespace(plan=SimpleNamespace(device="cpu", processes_per_machine=2, num_machines=1), tracking_uri=None)
    )
    assert int(env["OMP_NUM_THREADS"]) >= 1 and "NCCL_DEBUG" not in env


def test_torchrun_waits_the_runs_grace_before_killing_a_stopping_rank(monkeypatch):
    """accelerate launch's torchrun agent killed ranks 30 s after its SIGTERM, whatever training.preempt_grace_s
    gave them to checkpoint: the launch environment now sets the agent's shutdown timeout to the grace, and torch's
    own launcher reads it."""
    from torch.distributed.run import config_from_args, get_args_parser

    from ladle.config import build_config

    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    cfg = build_config({"base": "ladle://tiny-llama", "data": {"path": "x.jsonl"}}, ["training.preempt_grace_s=170.5"])
    env = worker_env(SimpleNamespace(plan=spec("cuda").plan, tracking_uri=None, config=cfg))
    assert env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "171"
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"])
    launch_config, _, _ = config_from_args(get_args_parser().parse_args(["--nproc-per-node", "2", "train.py"]))
    assert launch_config.shutdown_timeout == 171
