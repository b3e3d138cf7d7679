"""``psg-server``: run the gradient service until SIGINT/SIGTERM.

Shards run on the Ray worker pool unless ``--executor inprocess`` says otherwise: an embedded local
Ray by default, or the cluster at ``--ray-address`` / ``RAY_ADDRESS``.

    psg-server --host 0.0.0.0 --port 50051 --tokens-file tokens.txt --tls-cert cert.pem --tls-key key.pem
    psg-server --ray-address 10.0.0.1:6379 --cpus-per-worker 4
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Sequence

from psg_core.errors import PsgError
from psg_server.config import ServerConfig
from psg_server.service import create_server

__all__ = ["main", "serve"]

logger = logging.getLogger("psg_server")


async def serve(config: ServerConfig) -> None:
    """Runs a server until SIGINT or SIGTERM, then stops it gracefully."""
    server, port = await create_server(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    logger.info("psg-server: serving on port %d; Ctrl-C to stop", port)
    await stop.wait()
    logger.info("psg-server: shutting down")
    await server.stop(grace=5.0)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``psg-server`` console script; returns the exit status."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = ServerConfig.from_args(argv, defaults={"executor": "ray"})
    except PsgError as err:
        logger.error("%s", err)
        return 2
    logging.getLogger().setLevel(config.log_level)
    try:
        asyncio.run(serve(config))
    except PsgError as err:
        logger.error("psg-server: %s", err)
        return 2
    return 0
