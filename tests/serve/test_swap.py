"""Serving the champion behind ladle's front: versions swap under continuous traffic with zero failed requests,
a version that cannot start never takes traffic, and a rollback swaps back.

Real components: an MLflow registry on SQLite, the front and model servers as their own process groups, and
clients sending streaming and non-streaming requests through the front the whole time.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from ladle import promote
from ladle.config import ServeConfig
from ladle.errors import LadleError
from ladle.processes import free_port
from ladle.serve import champion, router
from tests.helpers import Traffic, wait_for_requests

NAME = "swap-demo"


@pytest.fixture(scope="module")
def two_models(tmp_path_factory, tiny_model) -> tuple[Path, Path]:
    """The tiny base, and a copy whose head is changed so its greedy answers differ."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    other = tmp_path_factory.mktemp("other-model")
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.copy_(torch.roll(model.lm_head.weight, shifts=7, dims=0))
    model.save_pretrained(other)
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(other)
    return Path(tiny_model), other


def test_swap_under_traffic_fails_no_request_and_rollback_swaps_back(tmp_path, two_models):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = ServeConfig(front_port=free_port(), max_new_tokens=6, drain_timeout_s=20)
    first, second = two_models
    v1 = promote.register(uri, NAME, str(first), None, {"ladle.model_sha256": "first"})
    promote.promote(uri, NAME, v1.version, "test")
    try:
        served = champion.reconcile(uri, NAME, cfg)
        assert (served.action, served.version, served.previous_version) == ("started", "1", None)
        front = served.front_url
        assert front == f"http://127.0.0.1:{cfg.front_port}"
        assert champion.reconcile(uri, NAME, cfg).action == "unchanged"

        with Traffic(front, NAME) as traffic:
            wait_for_requests(traffic, 8)
            v2 = promote.register(uri, NAME, str(second), None, {"ladle.model_sha256": "second"})
            promote.promote(uri, NAME, v2.version, "test")
            swapped = champion.reconcile(uri, NAME, cfg)
            t_swap = time.monotonic()
            wait_for_requests(traffic, 8)

            # A version that cannot start is refused before it takes any traffic; v2 keeps serving.
            broken = tmp_path / "broken"
            shutil.copytree(second, broken)
            (broken / "config.json").write_text("{not json")
            v3 = promote.register(uri, NAME, str(broken), None, {"ladle.model_sha256": "broken"})
            promote.promote(uri, NAME, v3.version, "test")
            with pytest.raises(champion.SwapFailed, match="v3 did not start or answer"):
                champion.reconcile(uri, NAME, cfg)
            t_failed = time.monotonic()
            wait_for_requests(traffic, 8)

            # Rollback (to the champion before v3, i.e. v2), then again (to v1): each swaps the front back.
            assert promote.rollback(uri, NAME) == ("3", "2")
            assert champion.reconcile(uri, NAME, cfg).action == "unchanged"  # v2 was never swapped out
            assert promote.rollback(uri, NAME) == ("2", "1")
            back = champion.reconcile(uri, NAME, cfg)
            t_back = time.monotonic()
            time.sleep(1.0)  # answers still being read when the swap returned are recorded by then
            wait_for_requests(traffic, 8)

        assert traffic.failures() == [], traffic.failures()[:5]
        assert (swapped.action, swapped.version, swapped.previous_version) == ("swapped", "2", "1")
        assert swapped.drained and swapped.front_url == front
        assert (back.action, back.version, back.previous_version) == ("swapped", "1", "2")
        seen = [r[1] for r in traffic.results]
        assert seen[0] == "1" and "2" in seen and seen[-1] == "1"
        assert traffic.versions_after(t_swap) - {"1", "2"} == set()
        assert "1" not in {r[1] for r in traffic.results if t_swap < r[0] < t_failed}  # after the swap: only v2
        assert "3" not in seen  # the broken version never answered
        assert traffic.versions_after(t_back + 0.5) == {"1"}
        assert {kind for _, _, kind in traffic.results} == {"stream", "whole"}
        # The swapped-out servers were drained and stopped: one server remains, behind the front.
        upstream = champion.current_upstream(router.read_record(NAME))
        assert upstream["version"] == "1" and champion.server_alive(upstream)
        assert not champion.server_alive({"pid": swapped.server_pid})
    finally:
        if router.read_record(NAME):
            champion.stop(NAME, grace_s=20)
    assert router.read_record(NAME) is None


def test_nothing_to_serve_and_busy_port_are_clear_errors(tmp_path, tiny_model):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with pytest.raises(LadleError, match="has no `champion`"):
        champion.reconcile(uri, "never-trained", ServeConfig())
    v1 = promote.register(uri, "busy", str(tiny_model), None, {})
    promote.promote(uri, "busy", v1.version, "test")
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(LadleError, match=f"serve.front_port = {port}: .*Free the port"):
            champion.reconcile(uri, "busy", ServeConfig(front_port=port))
    assert router.read_record("busy") is None
