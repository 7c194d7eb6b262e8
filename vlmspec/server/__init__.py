"""``vlmspec serve``: an OpenAI-compatible HTTP server over the batched engine (``pip install vlmspec[serve]``).

* :mod:`vlmspec.server.app`: :func:`create_app`, :func:`serve`, :class:`ServerConfig`.
* :mod:`vlmspec.server.background`: :class:`BackgroundServer`, a server on a thread (tests, notebooks).
* :mod:`vlmspec.server.worker`: :class:`EngineWorker`, the engine on its own thread.
* :mod:`vlmspec.server.protocol`: the chat-completions request schema and response bodies.
* :mod:`vlmspec.server.media`: image parts (base64 data URLs, allowed local paths).
* :mod:`vlmspec.server.metrics`: the Prometheus metrics.
"""

from __future__ import annotations

try:
    import fastapi  # noqa: F401
    import prometheus_client  # noqa: F401
    import uvicorn  # noqa: F401
except ImportError as err:
    raise ImportError(
        f"vlmspec serve needs the serving extra ({err.name} is missing): pip install 'vlmspec[serve]'"
    ) from err

from vlmspec.server.app import ServerConfig, create_app, serve
from vlmspec.server.background import BackgroundServer

__all__ = ["BackgroundServer", "ServerConfig", "create_app", "serve"]
