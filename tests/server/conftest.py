"""Fixtures shared by the server tests: one ``psg-server`` with a 1-worker pool for a test module
(``server``) and a client connected to it per test (``client``). A module that needs another
server defines its own ``server`` fixture, which takes precedence over this one."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from psg_client import GradientClient
from psg_server.background import BackgroundServer
from tests.server.service_harness import client_for, serve


@pytest.fixture(scope="module")
def server() -> Iterator[BackgroundServer]:
    with serve(num_workers=1) as running:
        yield running


@pytest.fixture()
def client(server: BackgroundServer) -> Iterator[GradientClient]:
    with client_for(server) as connected:
        yield connected
