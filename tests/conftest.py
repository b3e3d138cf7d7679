"""Fixtures shared by the whole test session.

``ray_session``: one local Ray instance for every test that needs Ray (pools create and kill their
own actors on it). It is started on first use with a few logical CPUs, no dashboard and a small
object store, and always shut down at the end of the session. ``address="local"`` makes it a new
instance of our own, never one that another process on the machine started.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent

#: Logical CPUs of the session's Ray (bookkeeping only: the pools of several tests may be alive at once).
RAY_TEST_CPUS = 8


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
