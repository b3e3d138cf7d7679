"""Synchronisation helpers for tests: wait for a condition, never for a guessed number of seconds."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path


def wait_until(condition: Callable[[], bool], timeout: float, what: str, *, interval: float = 0.02) -> None:
    """Returns as soon as ``condition()`` holds; fails the test after ``timeout`` seconds.

    Polling is for states that no event reports to this process (an actor's death, a server's
    health): ``interval`` only bounds how late the state is seen, never what the test assumes.
    """
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def wait_for_lines(path: Path, count: int, timeout: float, what: str) -> None:
    """Waits until ``path`` holds at least ``count`` lines (a signal written by other processes)."""
    wait_until(lambda: path.exists() and len(path.read_text().splitlines()) >= count, timeout, what)
