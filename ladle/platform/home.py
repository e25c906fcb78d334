"""Where ladle keeps what it makes once and reuses: ``$LADLE_HOME``, by default ``~/.cache/ladle``."""

from __future__ import annotations

import os
from pathlib import Path


def ladle_home() -> Path:
    return Path(os.environ.get("LADLE_HOME", Path.home() / ".cache" / "ladle")).expanduser()
