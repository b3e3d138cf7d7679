"""A process-wide choice among an enum's values (the convolution strategy, the matrix-product
kernel), and the measurement their ``auto`` settings make.

Set in code (for the process, or for a block), else read from an environment variable, else a
default that the caller computes (it may depend on the device). The setting is process-wide, like
``torch.backends.cudnn.benchmark``: every thread sees it.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, TypeVar

import torch

from psg_core.errors import ConfigError

__all__ = ["ProcessSetting", "time_candidates"]

logger = logging.getLogger(__name__)

E = TypeVar("E", bound=enum.Enum)
_Key = TypeVar("_Key")
#: timed rounds per candidate after one untimed call; the minimum is kept.
_ROUNDS = 3


class ProcessSetting(Generic[E]):
    """One setting: ``kind``'s values, the ``variable`` that sets the default, ``what`` for messages.

    >>> class Colour(str, enum.Enum):
    ...     RED = "red"
    ...     BLUE = "blue"
    >>> colour = ProcessSetting(Colour, "PSG_TEST_COLOUR", "colour")
    >>> with colour.scoped("blue", where="example"):
    ...     colour.current(Colour.RED)
    <Colour.BLUE: 'blue'>
    >>> colour.current(Colour.RED)
    <Colour.RED: 'red'>
    """

    def __init__(self, kind: type[E], variable: str, what: str) -> None:
        self.kind = kind
        self.variable = variable
        self.what = what
        self.forced: E | None = None

    def parse(self, value: E | str, *, where: str) -> E:
        """``value`` as one of the enum's members; a ConfigError naming them otherwise."""
        try:
            return self.kind(value)
        except ValueError:
            raise ConfigError(f"{where}: unknown {self.what} {value!r}; expected one of "
                              f"{[member.value for member in self.kind]}") from None

    def set(self, value: E | str | None, *, where: str) -> None:
        """Sets the value for the process (None: back to the environment variable or the default)."""
        self.forced = None if value is None else self.parse(value, where=where)

    @contextlib.contextmanager
    def scoped(self, value: E | str | None, *, where: str) -> Iterator[None]:
        """:meth:`set` for the duration of a block, then the previous setting."""
        previous = self.forced
        self.set(value, where=where)
        try:
            yield
        finally:
            self.forced = previous

    def current(self, default: E) -> E:
        """The value set, else the environment variable's, else ``default``."""
        if self.forced is not None:
            return self.forced
        from_env = os.environ.get(self.variable, "").strip()
        if from_env:
            return self.parse(from_env, where=f"environment variable {self.variable}")
        return default


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _out_of_memory(err: RuntimeError) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err)


def time_candidates(candidates: Mapping[_Key, Callable[[], Any]], device: torch.device) -> dict[_Key, float]:
    """Seconds per candidate: one untimed call each, then rounds of one call of every candidate
    (so load drifting during the measurement hits them alike); the minimum per candidate. A
    candidate that runs out of memory is left out.

    >>> sorted(time_candidates({"a": lambda: None, "b": lambda: None}, torch.device("cpu")))
    ['a', 'b']
    """
    alive: dict[_Key, Callable[[], Any]] = {}
    for key, run in candidates.items():
        try:
            run()  # untimed: lazy initialisation, cuDNN's own algorithm search
        except RuntimeError as err:
            if not _out_of_memory(err):
                raise
            logger.debug("candidate %s ran out of memory; not a candidate", getattr(key, "value", key))
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        alive[key] = run
    best = {key: math.inf for key in alive}
    for _ in range(_ROUNDS):
        for key, run in alive.items():
            _synchronize(device)
            start = time.perf_counter()
            run()
            _synchronize(device)
            best[key] = min(best[key], time.perf_counter() - start)
    return best
