"""The embedded Prefect API's failure paths, on a process that never answers or dies at once.

Through the CLI these depend on how long the run's own checks take (the server boots beside them),
so the budget is tested here, on the handle, where the timing is ours.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from ladle.platform.prefect_api import ApiUnavailable, EmbeddedApi
from ladle.platform.processes import free_port


def handle(tmp_path, code: str) -> EmbeddedApi:
    """An EmbeddedApi whose 'server' is ``code`` on a port nothing answers on."""
    api = EmbeddedApi(tmp_path)
    api.port = free_port()
    api.started_at = time.perf_counter()
    api.proc = subprocess.Popen([sys.executable, "-c", code])
    return api


def test_a_server_that_never_answers_runs_out_of_budget_and_is_stopped(tmp_path):
    api = handle(tmp_path, "import time; time.sleep(120)")
    proc = api.proc
    with pytest.raises(
        ApiUnavailable,
        match=r"PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS = 1: the temporary "
        r"Prefect API server did not answer in time .*set PREFECT_API_URL=",
    ):
        api.wait(1)
    assert proc.poll() is not None and api.proc is None  # stopped, not left behind


def test_a_server_that_dies_says_so_with_its_last_words(tmp_path):
    api = handle(tmp_path, "import sys; print('database is locked'); sys.exit(1)")
    api.proc.wait()
    api.log_path.write_text("database is locked\n")  # what start() would have captured from its output
    with pytest.raises(ApiUnavailable, match=r"exited with code 1 before answering \(database is locked; log: "):
        api.wait(30)
