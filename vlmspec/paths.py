"""Where vlmspec keeps what it builds once per machine (the reference target, tokenizers, kernels)."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "VLMSPEC_CACHE"


def default_cache_dir() -> Path:
    """``$VLMSPEC_CACHE``, else ``~/.cache/vlmspec``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "vlmspec")
