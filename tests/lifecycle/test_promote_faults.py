"""The registry's faults: a retried registration finds the version its first try made, and a registry that does
not answer is an error, never "no champion" (real MLflow: a SQLite store, and a server address nothing serves)."""

from __future__ import annotations

import pytest

from ladle.errors import LadleError
from ladle.lifecycle import promote
from ladle.platform.processes import free_port
from tests.helpers import fresh_registry


@pytest.fixture(scope="module")
def uri(tmp_path_factory):
    return fresh_registry(tmp_path_factory.mktemp("registry"))


def test_a_retried_registration_does_not_register_twice(uri, tmp_path):
    import mlflow

    mlflow.set_tracking_uri(uri)
    with mlflow.start_run() as run:
        pass
    first = promote.register(uri, "m", str(tmp_path / "merged"), run.info.run_id, {"a": "1"})
    again = promote.register(uri, "m", str(tmp_path / "merged"), run.info.run_id, {"a": "1"})
    assert again.version == first.version and [v.version for v in promote.versions(uri, "m")] == ["1"]
    assert promote.CHALLENGER in again.aliases
    other = promote.register(uri, "m", str(tmp_path / "merged-2"), run.info.run_id, {"a": "1"})
    assert other.version == "2"  # another folder of the same run is another version


def test_no_champion_is_none_and_an_unreachable_registry_is_an_error(uri, tmp_path, monkeypatch):
    assert promote.champion(uri, "never-registered") is None
    promote.register(uri, "fresh", str(tmp_path / "merged"), None, {})
    assert promote.champion(uri, "fresh") is None  # registered, nothing promoted yet
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    down = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(
        LadleError, match=rf"tracking.uri = {down}: the MLflow model registry failed while reading m@champion"
    ):
        promote.champion(down, "m")
    with pytest.raises(LadleError, match="failed while looking up registered model 'm'"):
        promote.register(down, "m", "x", None, {})


def test_a_registry_that_never_answers_is_an_error_within_the_configured_deadline(monkeypatch):
    """A server that accepts the connection and never answers (a listening socket nobody reads): with
    tracking.request_timeout_s=2 and request_retries=0 the champion lookup fails in seconds, not MLflow's
    default of 120 s per try and 7 retries."""
    import socket
    import time

    from ladle.config import build_config
    from ladle.lifecycle.tracking import tracking_uri

    for var in ("MLFLOW_HTTP_REQUEST_TIMEOUT", "MLFLOW_HTTP_REQUEST_MAX_RETRIES"):
        monkeypatch.delenv(var, raising=False)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        cfg = build_config(
            {
                "base": "ladle://tiny-llama",
                "data": {"path": "x"},
                "tracking": {"uri": url, "request_timeout_s": 2, "request_retries": 0},
            },
            [],
        )
        uri, _ = tracking_uri(cfg)
        began = time.monotonic()
        with pytest.raises(LadleError, match=rf"tracking.uri = {url}: the MLflow model registry failed while reading"):
            promote.champion(uri, "m")
        assert time.monotonic() - began < 20


def test_the_environment_sets_the_deadline_unless_the_config_does(monkeypatch):
    import os

    from ladle.config import build_config
    from ladle.lifecycle.tracking import apply_deadlines

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "7")
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", raising=False)
    apply_deadlines(build_config({"base": "b", "data": {"path": "x"}}, []))
    assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "7" and os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "3"
    apply_deadlines(build_config({"base": "b", "data": {"path": "x"}, "tracking": {"request_timeout_s": 5}}, []))
    assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "5"
