"""Fixtures shared by the whole test session.

``ray_session``: one local Ray instance for every test that needs Ray (pools create and kill their
own actors on it). It is started on first use with a few logical CPUs, no dashboard and a small
object store, and always shut down at the end of the session. ``address="local"`` makes it a new
instance of our own, never one that another process on the machine started.

The ``slow`` marker (registered in pyproject.toml) separates the unit tests of the core, the wire
and the service, which ``make test-fast`` runs, from everything ``make test`` adds: every test
under ``tests/integration`` (in-process and subprocess servers, Ray clusters, the demo, the
benchmarks), every test that uses ``ray_session``, and tests marked ``@pytest.mark.slow`` by hand.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent

_INTEGRATION = REPO / "tests" / "integration"

#: Logical CPUs of the session's Ray (bookkeeping only: the pools of several tests may be alive at once).
RAY_TEST_CPUS = 8


# tryfirst: the markers must be in place before pytest's own hook deselects by ``-m``.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks the tests of whole kinds ``slow`` (see the module docstring), so no file has to."""
    for item in items:
        if item.path.is_relative_to(_INTEGRATION) or "ray_session" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session", autouse=True)
def _state_home_of_this_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """``psg-server`` keeps its sessions under ``$XDG_STATE_HOME/psg`` unless given ``--state-dir``,
    and one server holds that directory at a time: every command this test session starts (as a
    subprocess, or ``cli.main`` in process) gets a state home of the session's own, never the
    developer's ``~/.local/state`` nor another test session's."""
    saved = os.environ.get("XDG_STATE_HOME")
    os.environ["XDG_STATE_HOME"] = str(tmp_path_factory.mktemp("state-home"))
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("XDG_STATE_HOME", None)
        else:
            os.environ["XDG_STATE_HOME"] = saved


@pytest.fixture(scope="session")
def ray_session() -> Iterator[Any]:
    """The session's Ray (the ``ray`` module, initialised)."""
    import ray

    if ray.is_initialized():
        raise RuntimeError("ray_session: Ray is already initialised in this test process")
    # Workers inherit the driver's environment: this lets them import the tests' model plugins.
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), saved) if p)
    try:
        ray.init(address="local", num_cpus=RAY_TEST_CPUS, include_dashboard=False,
                 object_store_memory=256 << 20, log_to_driver=False)
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved
    try:
        yield ray
    finally:
        ray.shutdown()
