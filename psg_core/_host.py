"""The numbers a step reads back from its tensors (how many clipped, the loss sum), read or deferred.

An eager step reads them as it goes (one device-to-host copy each). While
:class:`psg_core.capture.CapturedStep` records a step into a graph, a read would bake the recording
batch's value into every replay, so it is deferred instead: :func:`host_int` / :func:`host_float`
return a stand-in number that remembers its tensor, which the recording adds to the graph's
outputs, and each replay reads the tensor's new value in its place. The stand-ins are only ever
stored in a result (:class:`~psg_core.config.DPGradient`'s counts and loss sum), never used in
arithmetic or to choose a code path: code that needs a value to decide something calls
:func:`capturing` and takes a branch-free path instead (``clipping.dropped_samples``).

>>> import torch
>>> host_int(torch.tensor(3)), host_float(torch.tensor(0.5)), capturing()
(3, 0.5, False)
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TypeVar

import torch

__all__ = ["capturing", "host_int", "host_float", "expect_zero", "guard_read", "Deferred", "Guard", "Recording",
           "recording"]

_STATE = threading.local()


class Deferred:
    """Mixin of the stand-in numbers: ``slot`` indexes the recording's deferred tensors."""

    slot: int


class DeferredInt(int, Deferred):
    pass


class DeferredFloat(float, Deferred):
    pass


def capturing() -> bool:
    """Whether this thread is recording a step (values must not be read, nor decide a path)."""
    return getattr(_STATE, "deferred", None) is not None


_Number = TypeVar("_Number", DeferredInt, DeferredFloat)


def _stand_in(tensor: torch.Tensor, kind: type[_Number]) -> _Number | None:
    """A stand-in number for ``tensor`` while recording (its tensor appended to the deferred ones),
    else None."""
    deferred: list[torch.Tensor] | None = getattr(_STATE, "deferred", None)
    if deferred is None:
        return None
    number = kind(0)
    number.slot = len(deferred)
    deferred.append(tensor.detach().reshape(()))
    return number


def host_int(tensor: torch.Tensor) -> int:
    """``int(tensor.item())`` of a one-element tensor (deferred while recording)."""
    number = _stand_in(tensor, DeferredInt)
    return int(tensor.item()) if number is None else number


def host_float(tensor: torch.Tensor) -> float:
    """``float(tensor.item())`` of a one-element tensor (deferred while recording)."""
    number = _stand_in(tensor, DeferredFloat)
    return float(tensor.item()) if number is None else number


def expect_zero(tensor: torch.Tensor) -> None:
    """While recording: the recorded path is right only when the one-element ``tensor`` is 0 (how
    many samples' gradients are not finite: the path that zeroes them costs a pass over every
    per-sample gradient, taken eagerly only when needed). Its value becomes an output of the graph;
    a replay where it is not 0 is discarded and the batch computed eagerly."""
    guards: list[Guard] | None = getattr(_STATE, "guards", None)
    if guards is not None:
        number = _stand_in(tensor, DeferredInt)
        assert number is not None
        guards.append(Guard(number.slot, 0.0, truth=False, read=False))


def guard_read(tensor: torch.Tensor, value: bool | int | float, *, truth: bool) -> None:
    """While recording: the step read ``value`` from the one-element ``tensor`` into Python (a
    model's ``if mask.all():``), so the recorded path holds for a batch only where the tensor reads
    the same (``truth``: the same truth value, for ``bool(t)``). Its value becomes an output of the
    graph; a replay where it reads otherwise is discarded and the batch computed eagerly."""
    guards: list[Guard] | None = getattr(_STATE, "guards", None)
    if guards is not None:
        number = _stand_in(tensor, DeferredFloat)
        assert number is not None
        guards.append(Guard(number.slot, float(value), truth=truth, read=True))


@dataclass(frozen=True)
class Guard:
    """A condition on one deferred tensor (its ``slot``) for a recorded path to hold: its value
    equals ``expected`` (or, ``truth``, is nonzero exactly when ``expected`` is). ``read``: the step
    read the value to choose its path (a recording of another batch may take another path), as
    opposed to psg's :func:`expect_zero` (one path recorded whatever the batch)."""

    slot: int
    expected: float
    truth: bool
    read: bool

    def holds(self, value: float) -> bool:
        """Whether a replay's ``value`` of the tensor keeps the recorded path (NaN never does,
        unless only its truth counts)."""
        return (value != 0) == (self.expected != 0) if self.truth else value == self.expected


class Recording:
    """What a recorded step deferred: ``tensors`` (one-element, read after each replay) and
    ``guards`` (conditions on some of them for the replay to stand, see :func:`expect_zero` and
    :func:`guard_read`)."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self.guards: list[Guard] = []


@contextlib.contextmanager
def recording() -> Iterator[Recording]:
    """Defers this thread's reads for the block; yields where the deferred tensors go."""
    previous = getattr(_STATE, "deferred", None), getattr(_STATE, "guards", None)
    record = Recording()
    _STATE.deferred, _STATE.guards = record.tensors, record.guards
    try:
        yield record
    finally:
        _STATE.deferred, _STATE.guards = previous
