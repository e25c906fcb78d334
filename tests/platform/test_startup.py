"""``ladle.platform.startup``: imports with the collector paused, then frozen; third-party servers started that way."""

from __future__ import annotations

import gc
import json
import subprocess
import sys

from ladle.platform.startup import quiet_collector


def test_the_collector_is_paused_inside_and_what_was_built_is_frozen_after():
    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    with quiet_collector():
        assert not gc.isenabled()
        kept = [[i] for i in range(1000)]  # long-lived objects, as an import builds
    assert gc.isenabled()
    assert gc.get_freeze_count() >= frozen + len(kept)


def test_a_collector_that_was_off_stays_off_and_an_error_inside_still_unpauses():
    gc.disable()
    try:
        with quiet_collector():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
    try:
        with quiet_collector():
            raise KeyError("inside")
    except KeyError:
        pass
    assert gc.isenabled()


def test_the_module_runs_after_the_preload_with_its_arguments_and_exit_code():
    command = [sys.executable, "-m", "ladle.platform.startup", "json", "--", "-m", "json.tool", "--compact"]
    done = subprocess.run(command, input='{"a": [1, 2]}', capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"a": [1, 2]} and done.stdout.strip() == '{"a":[1,2]}'
    failed = subprocess.run(command, input="{broken", capture_output=True, text=True, timeout=60)
    assert failed.returncode == 1 and "Expecting property name" in failed.stderr


def test_a_command_without_its_module_is_refused_with_the_usage():
    for argv in (["json"], ["json", "--", "json.tool"], ["json", "--", "-m"]):
        done = subprocess.run(
            [sys.executable, "-m", "ladle.platform.startup", *argv], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 2 and done.stderr.startswith("usage: python -m ladle.platform.startup"), argv
