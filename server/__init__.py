"""psg_server: gRPC frontend of the psg gradient service (sessions, DP steps, shard executors).

Names load on first access (PEP 562): pool workers and clients that only need
``psg_server.models`` or ``psg_server.executor`` do not import the frontend, health and reflection.

>>> from psg_server import ServerConfig
>>> ServerConfig(port=0).address
'127.0.0.1:0'
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from psg_server.background import BackgroundServer
    from psg_server.config import ServerConfig
    from psg_server.executor import InProcessExecutor, ShardExecutor
    from psg_server.models import ModelRegistry, default_registry
    from psg_server.service import PsgServer, create_server

__all__ = [
    "BackgroundServer",
    "InProcessExecutor",
    "ModelRegistry",
    "PsgServer",
    "ServerConfig",
    "ShardExecutor",
    "create_server",
    "default_registry",
]

_MODULE_OF = {
    "BackgroundServer": "background",
    "InProcessExecutor": "executor",
    "ModelRegistry": "models",
    "PsgServer": "service",
    "ServerConfig": "config",
    "ShardExecutor": "executor",
    "create_server": "service",
    "default_registry": "models",
}


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
