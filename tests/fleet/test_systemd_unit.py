"""The front's service unit (infra/systemd/ladle-front@.service). No systemd runs here, so the unit's own command
line is expanded as systemd expands it (``%i``, ``${VAR}`` from its environment file) and run: it serves
``/health`` under the instance's name, and a SIGTERM (what ``systemctl stop`` sends) ends it with status 0. The
settings adoption relies on are checked: it restarts always and kills only the front, not the servers behind it."""

from __future__ import annotations

import configparser
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import httpx

from ladle.fleet import front as router
from ladle.platform.processes import free_port, stop_process

UNIT = Path(__file__).resolve().parents[2] / "infra" / "systemd" / "ladle-front@.service"


def service() -> dict[str, str]:
    parser = configparser.ConfigParser(interpolation=None, strict=False)
    parser.optionxform = str
    parser.read_string(UNIT.read_text())
    return dict(parser["Service"])


def test_the_unit_restarts_the_front_alone_and_its_command_serves(tmp_path):
    unit = service()
    assert unit["Restart"] == "always" and unit["KillMode"] == "process"
    assert unit["EnvironmentFile"] == "/etc/ladle/%i.env"
    env = {"LADLE_FRONT_HOST": "127.0.0.1", "LADLE_FRONT_PORT": str(free_port())}
    line = re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], unit["ExecStart"].replace("%i", "unit-test"))
    argv = shlex.split(line)
    assert argv[0].endswith("/bin/python") and argv[1:3] == ["-m", "ladle.fleet.front"]
    front = subprocess.Popen([sys.executable, *argv[1:]], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{env['LADLE_FRONT_PORT']}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert front.poll() is None, front.stdout.read()
            try:
                if httpx.get(f"{url}/health", timeout=2).json().get("model") == "unit-test":
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the unit's command never served /health"
            time.sleep(0.2)
        assert router.read_record("unit-test")["pid"] == front.pid
        front.terminate()
        assert front.wait(timeout=45) == 0
    finally:
        stop_process(front, grace_s=5)
