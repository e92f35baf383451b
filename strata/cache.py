"""Where Strata keeps what it makes once and reuses: the demo model, compiled helpers."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$STRATA_CACHE/strata, else $XDG_CACHE_HOME/strata, else ~/.cache/strata."""
    base = os.environ.get("STRATA_CACHE") or os.environ.get("XDG_CACHE_HOME")
    return Path(base) / "strata" if base else Path.home() / ".cache" / "strata"
