"""docs/cli.md is generated from the commands themselves (typer's docs generator), so it cannot drift."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import ROOT

COMMAND = [
    sys.executable,
    "-m",
    "typer",
    "ladle.cli.main",
    "utils",
    "docs",
    "--name",
    "ladle",
    "--title",
    "CLI reference",
]


def test_the_cli_reference_is_current():
    done = subprocess.run(COMMAND, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (ROOT / "docs" / "cli.md").read_text() == done.stdout.strip() + "\n", (
        "run: python -m typer ladle.cli.main utils docs --name ladle --title 'CLI reference' --output docs/cli.md"
    )


def test_the_http_events_and_metrics_reference_is_current():
    done = subprocess.run(
        [sys.executable, "-m", "ladle.cli.reference"], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert (ROOT / "docs" / "http.md").read_text() == done.stdout, "run: python -m ladle.cli.reference > docs/http.md"
    # Every route and event is there, from the code itself.
    for fragment in (
        "`/v1/chat/completions`",
        "`/ladle/canary`",
        "`ladle.model.canary_rolled_back`",
        "`ladle_front_canary_requests_total`",
    ):
        assert fragment in done.stdout
