from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from tests.compute.slurm_cluster import LocalSlurm, missing


def require_slurm() -> None:
    """Skip on a developer's machine without Slurm; fail in CI, where `make test` installs it (`make slurm`)."""
    absent = missing()
    if absent:
        message = f"Slurm is not installed ({', '.join(absent)} missing): run `make slurm`"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture(scope="session")
def slurm_client():
    """Slurm installed, as planning a Slurm target needs its client on PATH; no cluster started."""
    require_slurm()


@pytest.fixture(scope="session")
def slurm():
    """The two-node local Slurm cluster. Without Slurm installed it is a skip on a developer's machine and a
    failure in CI, where `make test` installs it (`make slurm`)."""
    require_slurm()
    # A short root: Slurm and munge put sockets under it, and a socket path has at most 107 bytes.
    cluster = LocalSlurm(Path(tempfile.mkdtemp(prefix="ladle-slurm-"))).start()
    yield cluster
    cluster.stop()


@pytest.fixture
def slurm_env(slurm, monkeypatch):
    """This test's environment points Slurm's clients at the local cluster."""
    for key in ("SLURM_CONF", "PATH"):
        monkeypatch.setenv(key, slurm.env[key])
    return slurm
