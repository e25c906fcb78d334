"""The tool host: an environment's tools run in a subprocess with a deadline and a cap, so a tool that raises,
hangs, prints, exits or returns something huge ends its own episode with a mark and never the run; the other
episodes' environments survive a killed host; and nothing outlives the training process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ladle.agents import environments
from ladle.agents.builtin import CALCULATOR_TOOLS, Calculator
from ladle.agents.tool_host import ToolHost

FAULTY = textwrap.dedent(
    '''
    import os, time

    class Faulty:
        """Tools that fail in every way a tool can, and a counter whose state a restarted host must keep."""

        def reset(self, start: int = 0):
            self.count = start
            return f"counting from {start}"

        def bump(self) -> str:
            """Add one to the counter."""
            self.count += 1
            return str(self.count)

        def boom(self) -> str:
            """Raise."""
            raise ValueError("the tool broke")

        def hang(self) -> str:
            """Never return."""
            time.sleep(3600)

        def huge(self) -> str:
            """Return ten million characters."""
            return "x" * 10_000_000

        def chatty(self) -> str:
            """Print to stdout, then answer."""
            print("noise on stdout " * 1000)
            return "fine"

        def leave(self) -> str:
            """Exit the process."""
            os._exit(3)
    '''
)


@pytest.fixture
def faulty(tmp_path) -> environments.Environment:
    path = tmp_path / "faulty.py"
    path.write_text(FAULTY)
    entry = f"{path}:Faulty"
    return environments.load(entry, environments.bundle(entry))


def test_the_calculator_does_arithmetic_and_never_runs_what_it_is_given_as_code(tmp_path):
    calc = Calculator()
    assert calc.calculate("12 * (3 + 4)") == "84"
    assert calc.calculate("7 / 2") == "3.5"
    assert calc.calculate("-3 - -4") == "1"
    assert calc.calculate("1 / 0") == "error: division by zero"
    assert calc.calculate("10 ** 10 ** 10").startswith("error: only numbers")  # no powers: no huge numbers
    assert calc.calculate("9" * 16 + " * 2").startswith("error: a number beyond")
    marker = tmp_path / "ran"
    assert calc.calculate(f"__import__('os').system('touch {marker}')").startswith("error:")
    assert not marker.exists()
    env = environments.load("calculator", {})
    (tool,) = env.tools
    assert [tool] == CALCULATOR_TOOLS  # what the built-in agent program offers
    assert tool["function"]["name"] == "calculate"
    assert tool["function"]["parameters"]["required"] == ["expression"]


def test_every_fault_of_a_tool_is_its_episodes_mark_and_the_other_episodes_keep_their_state(faulty):
    with ToolHost(faulty, timeout_s=1.0, max_result_tokens=64) as host:
        assert host.reset(0, {"start": 10, "other": "column"}).value == "counting from 10"
        assert host.reset(1, {}).value == "counting from 0"
        assert host.call(0, "bump", {}).value == "11"
        out = host.call(1, "boom", {})
        assert (out.ok, out.kind, out.error) == (False, "raised", "ValueError: the tool broke")
        assert host.call(1, "chatty", {}).value == "fine"  # its print went to stderr, not into the answers
        out = host.call(1, "huge", {})
        assert out.kind == "result_too_long" and "10,000,000 characters; at most 2,048" in out.error
        assert host.call(1, "nope", {}).kind == "unknown_tool"
        assert host.call(1, "_private", {}).kind == "unknown_tool"
        assert host.call(1, "bump", {"extra": 1}).kind == "bad_arguments"
        assert host.call(1, "bump", ["not", "an", "object"]).kind == "bad_arguments"
        first = host.proc.pid
        began = time.monotonic()
        out = host.call(1, "hang", {})
        assert out.kind == "tool_timeout" and out.error == "no answer within 1 s"
        assert time.monotonic() - began < 20
        assert host.proc.pid != first and host.restarts == 1
        with pytest.raises(ProcessLookupError):
            os.kill(first, 0)  # the hung host was killed, not left behind
        # Episode 0's environment was rebuilt in the new host by replaying its reset and calls: its counter goes on.
        assert host.call(0, "bump", {}).value == "12"
        assert host.call(1, "bump", {}).kind == "host_failed"  # the episode that hung it is over
        out = host.call(0, "leave", {})
        assert out.kind == "host_failed" and "exited" in out.error and host.restarts == 2
        assert host.call(0, "bump", {}).kind == "host_failed"
        assert host.reset(2, {"start": 5}).ok and host.call(2, "bump", {}).value == "6"
        last = host.proc.pid
    with pytest.raises(ProcessLookupError):
        os.kill(last, 0)


PARENT = """
import sys, time
from ladle.agents import environments
from ladle.agents.tool_host import ToolHost
entry = sys.argv[1]
path = entry.rsplit(":", 1)[0]
env = environments.Environment(entry, entry, open(path).read(), (), True)  # its tools' schemas are not needed here
host = ToolHost(env, timeout_s=600, max_result_tokens=64)
host.reset(0, {})
print(host.proc.pid, flush=True)
host.call(0, "hang", {})
"""


def test_a_host_dies_with_its_training_process_even_inside_a_hung_tool(faulty, tmp_path):
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, faulty.entry], stdout=subprocess.PIPE, text=True, cwd=Path.cwd()
    )
    try:
        pid = int(parent.stdout.readline())
        time.sleep(0.3)  # the call is under way: the host is inside time.sleep(3600)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            os.kill(pid, signal.SIGKILL)
            pytest.fail("the tool host outlived its parent")
    finally:
        if parent.poll() is None:
            parent.kill()


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("class E:\n    pass\n", "E has no public method to offer as a tool"),
        ("class E:\n    def look(self, x):\n        return x\n", "tool E.look cannot be described to the model"),
        ("import nothing_here\n", "cannot import it (ModuleNotFoundError"),
        ("class F:\n    pass\n", "has no class or function 'E'"),
    ],
)
def test_an_environment_that_cannot_be_used_is_one_error_naming_it(tmp_path, source, message):
    path = tmp_path / "env.py"
    path.write_text(source)
    entry = f"{path}:E"
    with pytest.raises(environments.EnvironmentError_, match="training.rl.environment") as raised:
        environments.load(entry, environments.bundle(entry))
    assert message in str(raised.value)
    with pytest.raises(environments.EnvironmentError_, match="no such file"):
        environments.bundle(str(tmp_path / "missing.py") + ":E")
    with pytest.raises(environments.EnvironmentError_, match="not a built-in"):
        environments.load("calculater", {})
