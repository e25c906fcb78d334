"""A server is supervised: it records itself while it runs, ``ladle servers`` finds it, and a stop drains
the request in flight (it completes) before the server exits 0 and its record goes."""

from __future__ import annotations

import json
import threading
import time

import httpx

from ladle.platform.processes import stop_process
from tests.helpers import run_cli, start_server


def test_servers_list_and_stop_drains_in_flight_requests(tiny_model, tmp_path):
    server, url = start_server(tiny_model, tmp_path / "server.log", name="drainme")
    try:
        listed = json.loads(run_cli("servers", "list", "--json", timeout=60).stdout.splitlines()[-1])
        mine = [s for s in listed["servers"] if s["pid"] == server.pid]
        assert mine and mine[0]["url"] == url and mine[0]["model"] == "drainme"

        lines: list[str] = []
        body = {"prompt": "Count", "max_tokens": 400, "temperature": 1.0, "seed": 3, "stream": True}

        def long_request() -> None:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
                lines.extend(line for line in response.iter_lines() if line)

        client = threading.Thread(target=long_request)
        client.start()
        while not lines:  # the request is in flight
            time.sleep(0.01)
        stopped = run_cli("servers", "stop", "drainme", "--grace", "60", "--json", timeout=120)
        client.join(timeout=60)
        assert json.loads(stopped.stdout.splitlines()[-1])["stopped"] == {str(server.pid): "stopped"}
        assert lines[-1] == "data: [DONE]"  # drained: the request in flight was finished, not cut
        assert server.wait(timeout=30) == 0
        after = json.loads(run_cli("servers", "list", "--json", timeout=60).stdout.splitlines()[-1])["servers"]
        assert all(s["pid"] != server.pid for s in after)
        assert run_cli("servers", "stop", "nope", timeout=60).returncode == 2
    finally:
        stop_process(server, grace_s=5, group=True)
