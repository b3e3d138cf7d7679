"""The devices the oracle suites run on, and the precision they compare at.

:data:`DEVICES` is what a test is parametrised over: ``"cpu"`` always, and ``"cuda"`` (marked
``cuda``) where torch sees a CUDA device. On a host without one the CUDA parameter is skipped at
collection, with its reason, so CPU-only runs (CI) take no longer than before; on a GPU host a
plain ``pytest`` runs both, and ``pytest -m cuda`` only the CUDA ones. ``PSG_REQUIRE_CUDA=1``
turns the skip into a failure, for runs that are meant to exercise a GPU (a host whose driver or
torch build does not see its GPU would otherwise pass with everything CUDA skipped).

Tests take the ``device`` fixture (tests/core/conftest.py), a ``torch.device``; they build their
models and batches on the CPU from fixed seeds, then move them there (:func:`to_device`), so both
devices see the same numbers and the oracle (tests/oracle.py) runs in float64 on the same device.

Precision policy for oracle comparisons on CUDA (:func:`oracle_precision`, applied by the
fixture): TF32 is switched off for matmuls and cuDNN convolutions, so float32 there is float32
(TF32 keeps 10 mantissa bits: ~1e-3 relative, above the suites' 1e-4 tolerances). psg_core itself
leaves TF32 as the user set it and accumulates norms in float32 whatever the parameters' dtype;
the half-precision cases (tests/core/test_autocast.py) compare at autocast's own tolerance.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest
import torch
from torch.nn.utils.rnn import PackedSequence

__all__ = ["CUDA_AVAILABLE", "CUDA_REQUIRED", "DEVICES", "cuda_param", "on_device", "oracle_precision", "requires_cuda",
           "to_device"]

_T = TypeVar("_T")
_F = TypeVar("_F", bound=Callable[..., Any])

#: Whether torch sees a CUDA device in this process.
CUDA_AVAILABLE = torch.cuda.is_available()
#: ``PSG_REQUIRE_CUDA=1``: the CUDA parameters run (and fail) where torch sees no CUDA device.
CUDA_REQUIRED = os.environ.get("PSG_REQUIRE_CUDA") == "1"

_NO_CUDA = "needs a CUDA device: torch.cuda.is_available() is False (PSG_REQUIRE_CUDA=1 makes this a failure)"


def _cuda_marks() -> list[pytest.MarkDecorator]:
    marks = [pytest.mark.cuda]
    if not CUDA_REQUIRED:
        marks.append(pytest.mark.skipif(not CUDA_AVAILABLE, reason=_NO_CUDA))
    return marks


def cuda_param(*values: Any, id: str | None = None) -> Any:  # noqa: A002 - pytest.param's own name
    """``pytest.param(*values)`` marked ``cuda`` and skipped where there is no CUDA device."""
    return pytest.param(*values, marks=_cuda_marks(), id=id)


def requires_cuda(test: _F) -> _F:
    """A test that is about CUDA itself: marked ``cuda`` and skipped where there is no CUDA device."""
    for mark in _cuda_marks():
        test = mark(test)
    return test


#: Every device an oracle test runs on (see the module docstring).
DEVICES = ["cpu", cuda_param("cuda", id="cuda")]


def on_device(tensor: torch.Tensor, device: torch.device | str) -> bool:
    """Whether ``tensor`` lives on ``device``; ``"cuda"`` (no index) means the current CUDA device,
    where tensors report ``cuda:0`` (``torch.device("cuda:0") != torch.device("cuda")``)."""
    wanted = torch.device(device)
    if wanted.type == "cuda" and wanted.index is None:
        wanted = torch.device("cuda", torch.cuda.current_device())
    return tensor.device == wanted


@contextlib.contextmanager
def oracle_precision(device: torch.device | str) -> Iterator[None]:
    """On CUDA: TF32 off for matmuls (``torch.backends.cuda.matmul.allow_tf32``) and cuDNN
    (``torch.backends.cudnn.allow_tf32``) while the block runs, both restored after. Nothing to do
    on the CPU, which has no TF32."""
    if torch.device(device).type != "cuda":
        yield
        return
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = matmul
        torch.backends.cudnn.allow_tf32 = cudnn


def to_device(value: _T, device: torch.device | str) -> _T:
    """``value`` on ``device``: tensors, modules (moved in place, as ``Module.to`` does) and packed
    sequences moved, tuples, lists and dicts of them rebuilt, anything else (None, numbers)
    returned as it is."""
    if isinstance(value, PackedSequence):  # before tuple, which it is; batch_sizes stays on the CPU
        return value.to(torch.device(device))  # type: ignore[arg-type, return-value]
    if isinstance(value, (torch.Tensor, torch.nn.Module)):
        return value.to(device)  # type: ignore[return-value]
    if isinstance(value, tuple):
        return tuple(to_device(v, device) for v in value)  # type: ignore[return-value]
    if isinstance(value, list):
        return [to_device(v, device) for v in value]  # type: ignore[return-value]
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}  # type: ignore[return-value]
    return value
