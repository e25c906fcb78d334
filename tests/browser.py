"""A real headless browser (Chromium) for the tests that look at the web UIs ladle's users look at: the
Prefect UI and MLflow's. `make browser` installs it (Debian's package), and `make test` runs that first."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

NAMES = ("chromium", "chromium-browser", "google-chrome")


def executable() -> str | None:
    return next((found for name in NAMES if (found := shutil.which(name))), None)


def require_browser() -> str:
    """Chromium's path. Without it: a skip on a developer's machine, a failure in CI (`make test` installs it)."""
    found = executable()
    if found is None:
        message = "no headless browser (chromium) on PATH: run `make browser`"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return found


def look(url: str, screenshot: Path, size: tuple[int, int] = (1400, 1000), settle_ms: int = 20000) -> str:
    """Load ``url`` in headless Chromium, let its scripts run (up to ``settle_ms`` of virtual time), save a
    screenshot and return the page's visible text (the rendered DOM without its tags)."""
    browser = require_browser()
    screenshot.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ladle-browser-") as profile:
        argv = [
            browser,
            "--headless",
            "--no-sandbox",  # tests run as root in CI containers
            "--disable-gpu",
            "--no-first-run",
            f"--user-data-dir={profile}",
            f"--window-size={size[0]},{size[1]}",
            f"--virtual-time-budget={settle_ms}",
            f"--screenshot={screenshot}",
            "--dump-dom",
            url,
        ]
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True
        )
        try:
            dom, _ = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
    assert proc.returncode == 0, f"chromium exited {proc.returncode} on {url}"
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"no PNG screenshot of {url}"
    text = re.sub(r"<script.*?</script>|<style.*?</style>", " ", dom, flags=re.S)
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", text))
