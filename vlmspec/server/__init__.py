"""``vlmspec serve``: an OpenAI-compatible HTTP server over the batched engine (``pip install vlmspec[serve]``).

* :mod:`vlmspec.server.app`: :func:`create_app`, :func:`serve`, :class:`ServerConfig`.
* :mod:`vlmspec.server.background`: :class:`BackgroundServer`, a server on a thread (tests, notebooks).
* :mod:`vlmspec.server.worker`: :class:`EngineWorker`, the engine on its own thread.
* :mod:`vlmspec.server.protocol`: the chat-completions request schema and response bodies.
* :mod:`vlmspec.server.media`: image parts (base64 data URLs, allowed local paths).
* :mod:`vlmspec.server.limits`: :class:`RequestLimits`, what one request may cost.
* :mod:`vlmspec.server.metrics`: the Prometheus metrics.

The limits import without the serving extra (the ``vlmspec`` command lists them in its
``--help``); the server itself needs it, and says so when it is missing.
"""

from __future__ import annotations

import importlib
from typing import Any

from vlmspec.server.limits import RequestLimits

_SERVER = {
    "BackgroundServer": "vlmspec.server.background",
    "ServerConfig": "vlmspec.server.app",
    "create_app": "vlmspec.server.app",
    "serve": "vlmspec.server.app",
}

__all__ = ["BackgroundServer", "RequestLimits", "ServerConfig", "create_app", "serve"]


def require_serving_extra() -> None:
    """Raise ImportError naming the extra to install if the server's dependencies are missing."""
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as err:
        raise ImportError(
            f"vlmspec serve needs the serving extra ({err.name} is missing): pip install 'vlmspec[serve]'"
        ) from err


def __getattr__(name: str) -> Any:
    if name in _SERVER:
        require_serving_extra()
        return getattr(importlib.import_module(_SERVER[name]), name)
    raise AttributeError(f"module 'vlmspec.server' has no attribute {name!r}")
