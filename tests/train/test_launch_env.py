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
