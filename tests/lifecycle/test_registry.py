"""The promotion gate's arithmetic, the registry's aliases and champion history, metric and run-id checks,
and secret redaction: against a real MLflow registry on SQLite, no mocks."""

from __future__ import annotations

import logging

import pytest

from ladle.config import load_config
from ladle.errors import ConfigError, LadleError
from ladle.lifecycle import gate, promote
from ladle.platform import secrets
from tests.helpers import ROOT, fresh_registry

RECIPE = str(ROOT / "recipes" / "tiny-cpu.yaml")


@pytest.mark.parametrize(
    ("higher", "candidate", "reference", "min_improvement", "promoted"),
    [
        (True, 0.9, 0.8, 0.0, True),
        (True, 0.8, 0.8, 0.0, False),  # equal is not better
        (True, 0.85, 0.8, 0.05, False),  # better, but by no more than needed
        (True, 0.86, 0.8, 0.05, True),
        (False, 1.9, 2.0, 0.0, True),  # loss: lower wins
        (False, 2.1, 2.0, 0.0, False),
    ],
)
def test_gate_compares_in_the_metric_direction(higher, candidate, reference, min_improvement, promoted):
    decision = gate.decide("m", higher, candidate, reference, "champion v1", min_improvement)
    assert decision.promoted is promoted
    assert decision.improvement == pytest.approx(candidate - reference if higher else reference - candidate)
    assert decision.reason.startswith("promoted: m" if promoted else "not promoted: m")
    assert "champion v1" in decision.reason and f"needed > {min_improvement:g}" in decision.reason


def test_an_unmeasured_metric_is_never_promoted():
    decision = gate.decide("exact_match", True, None, 0.5, "champion v2", 0.0)
    assert not decision.promoted and "was not measured for the new model" in decision.reason
    assert "promote.metric" in decision.reason


def test_aliases_history_and_rollback(tmp_path):
    uri = fresh_registry(tmp_path)
    assert promote.champion(uri, "m") is None and promote.versions(uri, "m") == []
    for n in range(1, 4):
        v = promote.register(uri, "m", f"/models/{n}", None, {"ladle.metric.loss": str(3.0 - n)})
        assert v.version == str(n) and v.aliases == [promote.CHALLENGER]
        promote.promote(uri, "m", v.version, f"better {n}")
    assert promote.history(uri, "m") == ["1", "2", "3"]
    listed = promote.versions(uri, "m")
    assert [(v.version, v.aliases) for v in listed] == [("3", ["challenger", "champion"]), ("2", []), ("1", [])]
    assert listed[0].metrics() == {"loss": 0.0}

    assert promote.rollback(uri, "m") == ("3", "2")
    assert promote.champion(uri, "m").version == "2"
    assert promote.rollback(uri, "m") == ("2", "1")
    with pytest.raises(LadleError, match="no previous champion to roll back to"):
        promote.rollback(uri, "m")
    assert promote.rollback(uri, "m", to="3") == ("1", "3")
    assert promote.rollback(uri, "m") == ("3", "1")  # back to the one before
    assert promote.champion(uri, "m").tags["ladle.champion_reason"] == "rollback from v3"
    with pytest.raises(LadleError, match="VERSION = '9': model 'm' has no such version"):
        promote.rollback(uri, "m", to="9")
    with pytest.raises(LadleError, match="already the champion"):
        promote.rollback(uri, "m", to="1")
    with pytest.raises(LadleError, match="NAME = 'nope': no registered model"):
        promote.rollback(uri, "nope")


def test_metric_settings_are_checked_with_the_fix():
    cfg = load_config(RECIPE, ["eval.metric=loss"])
    assert cfg.gate_metric() == "loss" and not cfg.eval.higher_wins()
    assert load_config(RECIPE, ["eval.metric=my_pkg.metrics:bleu"]).eval.higher_wins()
    with pytest.raises(
        ConfigError,
        match="eval.metric = 'bleu': use one of exact_match, loss, preference_accuracy, reward or an entry point",
    ):
        load_config(RECIPE, ["eval.metric=bleu"])
    with pytest.raises(ConfigError, match=r"promote.metric = 'bleu': only `loss` and eval.metric \('exact_match'\)"):
        load_config(RECIPE, ["promote.metric=bleu"])


def test_a_user_metric_that_cannot_be_imported_or_returns_junk_is_a_clear_error(tmp_path, monkeypatch):
    from ladle.config import EvalConfig
    from ladle.lifecycle.evaluate import task_score

    (tmp_path / "my_metrics.py").write_text(
        "def junk(model_dir, conversations):\n    return 'high'\n"
        "def count(model_dir, conversations):\n    return len(conversations)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    samples = [[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]]
    assert task_score(EvalConfig(metric="my_metrics:count"), tmp_path, samples).values == {"my_metrics:count": 1.0}
    with pytest.raises(LadleError, match="returned 'high'; it must return a finite number"):
        task_score(EvalConfig(metric="my_metrics:junk"), tmp_path, samples)
    with pytest.raises(LadleError, match="eval.metric = 'no_such_module:f': cannot import it"):
        task_score(EvalConfig(metric="no_such_module:f"), tmp_path, samples)


def test_secrets_are_masked_in_text_urls_and_log_records(monkeypatch, caplog):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws-secret-value-123")
    monkeypatch.setenv("MY_SERVICE_TOKEN", "tok-abcdef-999")
    secrets.register("served-api-key-42")
    text = "s3 key aws-secret-value-123, token tok-abcdef-999, key served-api-key-42, https://bob:pw12345@h:5000/x"
    clean = secrets.redact(text)
    for secret in ("aws-secret-value-123", "tok-abcdef-999", "served-api-key-42", "pw12345"):
        assert secret not in clean
    assert "https://bob:***@h:5000/x" in clean
    assert secrets.redact_url("http://u:p4ssw0rd@mlflow:5000/api") == "http://u:***@mlflow:5000/api"
    assert secrets.redact_url("http://mlflow:5000") == "http://mlflow:5000"

    logger = logging.getLogger("ladle.test-redaction")
    handler = logging.Handler()
    records = []
    handler.emit = records.append
    logger.addHandler(handler)
    handler.addFilter(secrets.RedactSecrets())
    logger.warning("connecting with %s", "aws-secret-value-123")
    logger.removeHandler(handler)
    assert records[0].getMessage() == "connecting with ***"


def test_tracking_credentials_are_kept_for_their_server(monkeypatch):
    from ladle.lifecycle import tracking
    from ladle.platform.secrets import credential_env, with_credentials

    monkeypatch.delenv("MLFLOW_TRACKING_USERNAME", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD", raising=False)
    assert tracking.strip_credentials("https://ann:s3cr%40t@mlflow.example:8443/") == "https://mlflow.example:8443/"
    import os

    assert "MLFLOW_TRACKING_PASSWORD" not in os.environ
    assert credential_env("https://mlflow.example:8443/x") == {
        "MLFLOW_TRACKING_USERNAME": "ann",
        "MLFLOW_TRACKING_PASSWORD": "s3cr@t",
    }
    assert with_credentials("https://mlflow.example:8443/") == "https://ann:s3cr%40t@mlflow.example:8443/"
    assert tracking.strip_credentials("sqlite:////tmp/m.db") == "sqlite:////tmp/m.db"
