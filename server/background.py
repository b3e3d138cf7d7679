"""A server on a background thread with its own event loop: for notebooks, demos and tests.

>>> with BackgroundServer(ServerConfig(port=0)) as server:
...     server.port > 0
True
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from types import TracebackType
from typing import Any

from psg_server.config import ServerConfig
from psg_server.service import PsgServer, create_server

__all__ = ["BackgroundServer"]


class BackgroundServer:
    """Runs :func:`~psg_server.service.create_server` on a daemon thread.

    Args:
        config: the server's configuration (``port=0`` for an ephemeral port).
        **create_kwargs: passed to :func:`~psg_server.service.create_server` (executor, registry).
    """

    def __init__(self, config: ServerConfig, **create_kwargs: Any) -> None:
        self.config = config
        self._create_kwargs = create_kwargs
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="psg-server", daemon=True)
        self.server: PsgServer | None = None
        self.port = 0

    @property
    def target(self) -> str:
        """``host:port`` for a client."""
        return f"{self.config.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> BackgroundServer:
        """Starts the thread and the server; returns self once the port is bound."""
        self._thread.start()
        self.server, self.port = self.call(create_server(self.config, **self._create_kwargs), timeout=timeout)
        return self

    def call(self, coroutine: Any, timeout: float = 60.0) -> Any:
        """Runs a coroutine on the server's loop and returns its result."""
        future: concurrent.futures.Future[Any] = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        return future.result(timeout)

    def stop(self, grace: float | None = 1.0) -> None:
        """Stops the server and the thread."""
        if self.server is not None:
            self.call(self.server.stop(grace))
            self.server = None
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        if not self._loop.is_closed() and not self._loop.is_running():
            self._loop.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
