import httpx
import pytest

from ladle.config import ServeConfig
from ladle.errors import LadleError
from ladle.fleet.deploy import deploy
from ladle.lifecycle.merge import MergedModel
from tests.helpers import stop_pid


def test_keep_running_leaves_a_healthy_server(tiny_model):
    merged = MergedModel(url=str(tiny_model), sha256="0" * 64, parameters=0)
    endpoint = deploy(merged, ServeConfig(keep_running=True, max_new_tokens=4), "tiny")
    try:
        assert endpoint.running and endpoint.pid
        assert httpx.get(f"{endpoint.url}/v1/models", timeout=10).json()["data"][0]["id"] == "tiny"
    finally:
        stop_pid(endpoint.pid)


def test_default_stops_the_server_after_the_smoke_request(tiny_model):
    merged = MergedModel(url=str(tiny_model), sha256="0" * 64, parameters=0)
    endpoint = deploy(merged, ServeConfig(max_new_tokens=4), "tiny")
    assert not endpoint.running and endpoint.pid is None
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{endpoint.url}/health", timeout=2)


def test_mii_on_a_cpu_host_is_an_error_not_a_fallback(tiny_model):
    merged = MergedModel(url=str(tiny_model), sha256="0" * 64, parameters=0)
    with pytest.raises(LadleError, match="serve.backend = mii: DeepSpeed-MII has no CPU path"):
        deploy(merged, ServeConfig(backend="mii"), "tiny")
