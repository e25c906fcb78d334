"""``ladle.platform.startup``: imports with the collector paused, then frozen; third-party servers started that way."""

from __future__ import annotations

import gc
import json
import subprocess
import sys

from ladle.platform.startup import THRESHOLDS, flow_run_process, quiet_collector


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


def test_the_ladle_command_and_a_workers_flow_run_raise_the_thresholds_and_a_borrowed_process_keeps_its_own(
    monkeypatch,
):
    from importlib.metadata import entry_points

    import ladle.cli.main as cli

    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "ladle"]
    assert script.value == "ladle.cli.main:main"
    before = gc.get_threshold()
    assert before != THRESHOLDS
    seen = []
    monkeypatch.setattr(cli, "app", lambda: seen.append(gc.get_threshold()))
    try:
        cli.main()
        assert seen == [THRESHOLDS]  # raised before any handler imports its libraries
        gc.set_threshold(*before)
        monkeypatch.delenv("PREFECT__FLOW_RUN_ID", raising=False)
        flow_run_process()  # a flow called in this process (a test, a notebook): its collector is its own
        assert gc.get_threshold() == before
        monkeypatch.setenv("PREFECT__FLOW_RUN_ID", "0b3c5d1e-2f4a-4b6c-8d9e-0f1a2b3c4d5e")
        flow_run_process()  # the process a worker started for the run
        assert gc.get_threshold() == THRESHOLDS
    finally:
        gc.set_threshold(*before)
