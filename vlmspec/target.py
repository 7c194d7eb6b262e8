"""The old name of :mod:`vlmspec.targets`, kept so that existing imports keep working.

The package was renamed because ``target/`` is a folder name that common tooling
(``.gitignore`` templates, indexers, code maps) treats as build output and skips.
``import vlmspec.target.adapter`` and ``from vlmspec.target import QwenVLTarget`` resolve to
the modules of :mod:`vlmspec.targets`; new code should import those directly.
"""

from __future__ import annotations

import importlib
import sys

from vlmspec.targets import *  # noqa: F403 (the public names, re-exported)
from vlmspec.targets import __all__  # noqa: F401

_SUBMODULES = ("adapter", "batch", "inputs", "positions", "processor", "profile", "ragged", "tiny")
for _name in _SUBMODULES:
    sys.modules[f"{__name__}.{_name}"] = importlib.import_module(f"vlmspec.targets.{_name}")
