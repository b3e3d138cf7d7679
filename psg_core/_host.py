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
from typing import TypeVar

import torch

__all__ = ["capturing", "host_int", "host_float", "Deferred", "recording"]

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


@contextlib.contextmanager
def recording() -> Iterator[list[torch.Tensor]]:
    """Defers this thread's reads for the block; yields the list the deferred tensors go to."""
    previous = getattr(_STATE, "deferred", None)
    deferred: list[torch.Tensor] = []
    _STATE.deferred = deferred
    try:
        yield deferred
    finally:
        _STATE.deferred = previous
