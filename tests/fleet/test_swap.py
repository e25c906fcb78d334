"""Serving the champion behind ladle's front: a version that cannot start never takes traffic, and the errors
a user can meet (nothing promoted, the front's port taken) are clear. Real components: an MLflow registry on
SQLite, the front and model servers as their own process groups."""

from __future__ import annotations

import shutil

import httpx
import pytest

from ladle.config import ServeConfig
from ladle.errors import LadleError
from ladle.fleet import champion
from ladle.fleet import front as router
from ladle.lifecycle import promote
from ladle.platform.processes import free_port
from ladle.serve import records
from tests.helpers import fresh_registry

NAME = "swap-demo"


def test_a_version_that_cannot_start_never_takes_traffic(tmp_path, tiny_model):
    """Swaps under traffic, rollbacks and drained old servers run through the deployments in
    tests/pipeline/test_deployment.py; here: a broken champion is refused and the old version keeps serving."""
    uri = fresh_registry(tmp_path)
    cfg = ServeConfig(front_port=free_port(), max_new_tokens=6, drain_timeout_s=20)
    v1 = promote.register(uri, NAME, str(tiny_model), None, {"ladle.model_sha256": "first"})
    promote.promote(uri, NAME, v1.version, "test")
    try:
        served = champion.reconcile(uri, NAME, cfg)
        assert (served.action, served.version, served.previous_version) == ("started", "1", None)
        assert served.front_url == f"http://127.0.0.1:{cfg.front_port}"
        assert champion.reconcile(uri, NAME, cfg).action == "unchanged"

        broken = tmp_path / "broken"
        shutil.copytree(tiny_model, broken)
        (broken / "config.json").write_text("{not json")
        v2 = promote.register(uri, NAME, str(broken), None, {"ladle.model_sha256": "broken"})
        promote.promote(uri, NAME, v2.version, "test")
        with pytest.raises(champion.SwapFailed, match="v2 did not start or answer, so it takes no traffic"):
            champion.reconcile(uri, NAME, cfg)
        body = {"model": NAME, "messages": [{"role": "user", "content": "red blue"}], "max_tokens": 4}
        answer = httpx.post(f"{served.front_url}/v1/chat/completions", json=body, timeout=60)
        assert answer.status_code == 200 and answer.headers[router.VERSION_HEADER] == "1"
        upstream = champion.current_upstream(router.read_record(NAME))
        assert upstream["pid"] == served.server_pid and records.alive(upstream)

        assert promote.rollback(uri, NAME) == ("2", "1")
        assert champion.reconcile(uri, NAME, cfg).action == "unchanged"  # v1 never stopped serving
    finally:
        if router.read_record(NAME):
            champion.stop(NAME, grace_s=20)
    assert router.read_record(NAME) is None
    assert not records.alive({"pid": served.server_pid})


def test_nothing_to_serve_and_busy_port_are_clear_errors(tmp_path, tiny_model):
    uri = fresh_registry(tmp_path)
    with pytest.raises(LadleError, match="has no `champion`"):
        champion.reconcile(uri, "never-trained", ServeConfig())
    assert router.read_record("never-trained") is None  # refused before any front was started
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
