"""Free TCP ports for test processes that must be told their ports up front.

Ports are drawn below the kernel's ephemeral range (where Ray's own servers and every ``bind(0)``
land), and never handed out twice in one test session, so a port picked now is not taken by a
process started a moment later.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_HANDED_OUT: set[int] = set()


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port on 127.0.0.1 that is free now, outside the ephemeral range and Ray's worker ports."""
    low, high = 20000, min(_ephemeral_start(), 32768)  # Ray's worker ports are 10002-19999
    for _ in range(500):
        port = random.randrange(low, high)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError(f"no free port in {low}-{high}")
