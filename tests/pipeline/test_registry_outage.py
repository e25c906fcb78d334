"""The promote stage when the registry goes away: a real `mlflow server` (SQLite) stopped in the middle of a
promotion, then started again on the same store and port.

The failed promotion is one clear error; the registry still serves the champion it had (the new version is
registered as `challenger`, nothing more); the rerun finds that version, gates it against the same champion,
and promotes it: one version for the run, the history appended once. A first try that died right after the
alias flip is finished by its rerun the same way.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ladle.errors import LadleError
from ladle.lifecycle import gate, promote
from ladle.platform.processes import free_port, stop_process
from tests.helpers import fresh_registry, start_service

LOSS = gate.Rule(metric="loss", greater_is_better=False)

pytestmark = pytest.mark.pipeline


def start_mlflow(home: Path, port: int) -> subprocess.Popen:
    argv = [str(Path(sys.executable).with_name("mlflow")), "server", "--host", "127.0.0.1", "--port", str(port)]
    if not (home / "mlflow.db").exists():  # a restart keeps its store
        fresh_registry(home)
    argv += ["--backend-store-uri", f"sqlite:///{home}/mlflow.db", "--artifacts-destination", str(home / "art")]
    argv += ["--workers", "1"]
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    return start_service(argv, f"http://127.0.0.1:{port}/health", home, env)


def runs(url: str, count: int) -> list[str]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(url)
    experiment = client.get_experiment_by_name("Default").experiment_id
    return [client.create_run(experiment).info.run_id for _ in range(count)]


def test_a_registry_stopped_during_promote_fails_once_and_the_rerun_promotes_one_version(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # fail now, not after minutes of backoff
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_mlflow(tmp_path, port)
    try:
        first_run, second_run = runs(url, 2)
        v1, d1, _ = gate.gate_and_promote(
            url, "m", "s3://ladle/models/one", {"loss": 1.0}, lambda c: ({"loss": 2.0}, "base model"), LOSS, run_id=first_run
        )  # fmt: skip
        assert v1.version == "1" and d1.promoted

        def stop_registry_while_scoring_the_champion(current):
            assert current is not None and current.version == "1"
            stop_process(server, group=True)
            return {"loss": 1.0}, f"champion v{current.version}"

        with pytest.raises(LadleError) as err:
            gate.gate_and_promote(
                url, "m", "s3://ladle/models/two", {"loss": 0.5}, stop_registry_while_scoring_the_champion, LOSS,
                run_id=second_run,
            )  # fmt: skip
        message = str(err.value)
        # The first registry call after the scoring: taking the champion lock, before anything is written.
        assert message.startswith(
            f"tracking.uri = {url}: the MLflow model registry failed while taking m's champion lock for the gate of v2"
        )
        assert message.endswith("Nothing was decided; run it again once the registry answers.")
        assert "\n" not in message and err.value.exit_code == 1

        server = start_mlflow(tmp_path, port)  # the same store, the same address
        assert promote.champion(url, "m").version == "1"  # what is served did not change
        by_version = {v.version: v.aliases for v in promote.versions(url, "m")}
        assert by_version == {"2": ["challenger"], "1": ["champion"]}

        v2, d2, against = gate.gate_and_promote(
            url, "m", "s3://ladle/models/two", {"loss": 0.5}, lambda c: ({"loss": 1.0}, f"champion v{c.version}"), LOSS,
            run_id=second_run,
        )  # fmt: skip
        assert v2.version == "2" and d2.promoted and against.version == "1"
        assert d2.reason.startswith("promoted: loss 0.5 vs champion v1 1")
        assert [v.version for v in promote.versions(url, "m")] == ["2", "1"]  # one version for the run
        assert promote.champion(url, "m").version == "2" and promote.history(url, "m") == ["1", "2"]

        # A refusal is not an outage: a local folder the server cannot reach, said as such.
        with pytest.raises(LadleError) as refused:
            promote.register(url, "m", str(tmp_path / "merged"), second_run, {})
        assert "the MLflow model registry refused registering" in str(refused.value)
        assert "set output to a URL both can reach" in str(refused.value)
    finally:
        stop_process(server, group=True)


def test_a_promotion_that_died_after_the_alias_flip_is_finished_by_its_rerun(tmp_path):
    """The first try pointed `champion` at v2 and died before its history and tags: the rerun gates v2 against
    v1 again (not against itself, which it could never beat) and completes the bookkeeping once."""
    from mlflow.tracking import MlflowClient

    url = fresh_registry(tmp_path)
    first_run, second_run = runs(url, 2)
    gate.gate_and_promote(
        url, "m", "s3://ladle/models/one", {"loss": 1.0}, lambda c: ({"loss": 2.0}, "base model"), LOSS, run_id=first_run
    )  # fmt: skip
    v2 = promote.register(url, "m", "s3://ladle/models/two", second_run, {})
    MlflowClient(url).set_registered_model_alias("m", promote.CHAMPION, v2.version)  # the flip, then the crash

    seen = []

    def reference(current):
        seen.append(current.version if current else None)
        return {"loss": 1.0}, f"champion v{current.version}"

    again, decision, against = gate.gate_and_promote(
        url, "m", "s3://ladle/models/two", {"loss": 0.5}, reference, LOSS, run_id=second_run
    )
    assert again.version == "2" and decision.promoted and seen == ["1"] and against.version == "1"
    assert promote.history(url, "m") == ["1", "2"] and promote.champion(url, "m").version == "2"
    assert [v.version for v in promote.versions(url, "m")] == ["2", "1"]
    # And the history stays right for a rollback: back to v1.
    assert promote.rollback(url, "m") == ("2", "1")
