"""``psg-server``: run the gradient service until SIGINT/SIGTERM.

Shards run on the Ray worker pool unless ``--executor inprocess`` says otherwise: an embedded local
Ray by default, or the cluster at ``--ray-address`` / ``RAY_ADDRESS``.

    psg-server --host 0.0.0.0 --port 50051 --tokens-file tokens.txt --tls-cert cert.pem --tls-key key.pem
    psg-server --ray-address 10.0.0.1:6379 --cpus-per-worker 4
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import MutableMapping, Sequence

from psg_core.errors import PsgError
from psg_server.config import ServerConfig, default_state_dir

# No import above loads gRPC: main() prepares gRPC's environment first, and serve() imports the
# service (and with it gRPC) only then.

__all__ = ["command_defaults", "main", "serve"]

logger = logging.getLogger("psg_server")

#: What the command sets in the environment before gRPC loads, unless the operator set it already.
_GRPC_ENVIRONMENT = {
    # gRPC's fork handlers exist for children that keep using gRPC after fork() without exec().
    # This process forks only to exec (the embedded Ray starts its GCS, raylet and helpers that
    # way), so the handlers buy nothing; with the frontend's threads in gRPC they only print
    # "fork_posix.cc ... skipping fork() handlers" at every fork.
    "GRPC_ENABLE_FORK_SUPPORT": "false",
}


def _prepare_grpc_environment(environ: MutableMapping[str, str] = os.environ) -> None:
    """Applies :data:`_GRPC_ENVIRONMENT` where ``environ`` does not set the name already.

    It takes effect only while gRPC is not yet imported, and children (Ray's processes) inherit it.
    """
    for name, value in _GRPC_ENVIRONMENT.items():
        environ.setdefault(name, value)


async def serve(config: ServerConfig) -> None:
    """Runs a server until SIGINT or SIGTERM, then stops it gracefully."""
    from psg_server.service import create_server

    server, port = await create_server(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    logger.info("psg-server: serving on port %d; Ctrl-C to stop", port)
    await stop.wait()
    logger.info("psg-server: shutting down")
    await server.stop(grace=5.0)


def command_defaults() -> dict[str, object]:
    """What the command sets over :class:`ServerConfig`'s library defaults: shards on the Ray pool,
    sessions kept on disk (:func:`~psg_server.config.default_state_dir`)."""
    return {"executor": "ray", "state_dir": default_state_dir()}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``psg-server`` console script; returns the exit status."""
    _prepare_grpc_environment()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Domain errors name where they come from ("ServerConfig: ...", "psg-server: refusing ..."):
    # they are logged as they are, with no prefix of ours.
    try:
        config = ServerConfig.from_args(argv, defaults=command_defaults())
    except PsgError as err:
        logger.error("%s", err)
        return 2
    logging.getLogger().setLevel(config.log_level)
    try:
        asyncio.run(serve(config))
    except PsgError as err:
        logger.error("%s", err)
        return 2
    return 0
