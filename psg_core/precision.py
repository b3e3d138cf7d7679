"""Precision policy: per-sample arithmetic in the parameters' precision, never in autocast's.

Under ``torch.autocast`` a layer's forward runs in bf16/fp16 while its parameters stay fp32, so
the gradients that reach a grad sampler are half precision and the activations it kept may be
either. psg computes per-sample gradients, norms and clipped sums from those in the parameters'
dtype (fp32 for an fp32 model), with autocast switched off, so that the clipping bound holds for
what is summed and every returned gradient has its parameter's dtype. A model whose parameters
are themselves bf16 (no autocast) keeps computing in bf16; norms are always fp32.

TF32: psg leaves ``torch.backends.cuda.matmul.allow_tf32`` / ``cudnn.allow_tf32`` as the user set
them; with TF32 on, CUDA convolutions differ from an fp32 reference by ~1e-3 relative.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

_T = TypeVar("_T")
logger = logging.getLogger(__name__)

import torch

__all__ = ["no_autocast", "compute_dtype", "layer_dtype", "to_compute", "as_dtype", "autocast_active", "fp16_autocast",
           "with_loss_scale", "INITIAL_LOSS_SCALE"]

#: The first loss scale tried under fp16 autocast (halved by 16x until the result is finite).
INITIAL_LOSS_SCALE = 2.0 ** 16


def autocast_active() -> bool:
    """Whether an autocast region is active on any device type psg runs on."""
    # (asking "cuda" is answered False without CUDA, and costs less than torch.cuda.is_available())
    return torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda")


class no_autocast:  # noqa: N801 (a context manager used like a function: ``with no_autocast():``)
    """Switches autocast off (CPU and CUDA) for psg's own arithmetic.

    A class rather than a generator: it is entered on every hooked call, and in the common case
    (no autocast region) it only asks whether one is active.

    >>> with torch.autocast("cpu", dtype=torch.bfloat16):
    ...     with no_autocast():
    ...         (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
    torch.float32
    """

    __slots__ = ("_stack",)

    def __init__(self) -> None:
        self._stack: contextlib.ExitStack | None = None

    def __enter__(self) -> None:
        if not autocast_active():  # the common case: nothing to switch off
            return
        stack = self._stack = contextlib.ExitStack()
        stack.enter_context(torch.autocast("cpu", enabled=False))
        if torch.cuda.is_available():
            stack.enter_context(torch.autocast("cuda", enabled=False))

    def __exit__(self, *exc: Any) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.__exit__(*exc)


#: the floating dtypes that promote with float32 to float32
_SINGLE_OR_BELOW = frozenset({torch.float16, torch.bfloat16, torch.float32})


def norm_dtype(dtypes: Iterable[torch.dtype]) -> torch.dtype:
    """The dtype per-sample norms are taken in: float32 at least, the promotion of float32 and
    ``dtypes`` (float64 gradients keep float64 norms, so their clipping factors stay exact).
    Promoted once per distinct dtype: each promotion is a dispatch.

    >>> norm_dtype([torch.bfloat16, torch.float16]), norm_dtype([torch.float32, torch.float64])
    (torch.float32, torch.float64)
    """
    distinct = set(dtypes)
    if distinct <= _SINGLE_OR_BELOW:
        return torch.float32
    return functools.reduce(torch.promote_types, distinct, torch.float32)


def compute_dtype(params: Iterable[torch.Tensor]) -> torch.dtype:
    """The dtype per-sample arithmetic runs in: the promotion of the parameters' floating dtypes
    (fp32 when there is none).

    >>> compute_dtype([torch.zeros(1, dtype=torch.bfloat16), torch.zeros(1)])
    torch.float32
    """
    floating = {p.dtype for p in params if p.is_floating_point()}
    if len(floating) == 1:
        return floating.pop()  # (the common case: no promotion to ask torch for)
    return functools.reduce(torch.promote_types, floating) if floating else torch.float32


def layer_dtype(layer: torch.nn.Module) -> torch.dtype:
    """:func:`compute_dtype` of a layer's own parameters (read from ``_parameters`` directly: this
    runs once per layer call in the backward pass)."""
    return compute_dtype(p for p in layer._parameters.values() if p is not None)


def to_compute(value: Any, dtype: torch.dtype) -> Any:
    """A floating tensor cast to ``dtype`` (anything else unchanged)."""
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype:
        return value.to(dtype)
    return value


def as_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor.to(dtype)``, without the call when it already is (the common case, on every layer:
    reading the dtype costs less than ``to``'s argument parsing and dispatch)."""
    return tensor if tensor.dtype == dtype else tensor.to(dtype)


def fp16_autocast() -> bool:
    """Whether an autocast region computing in float16 is active (its gradients can underflow)."""
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    return any(torch.is_autocast_enabled(d) and torch.get_autocast_dtype(d) == torch.float16 for d in devices)


def with_loss_scale(run: Callable[[float], _T], finite: Callable[[_T], bool]) -> _T:
    """``run(scale)`` with the backward pass's loss multiplied by ``scale`` (the caller divides its
    results by it): 1 unless fp16 autocast is on, where small per-sample gradients would underflow
    float16; then ``INITIAL_LOSS_SCALE``, divided by 16 and run again while the result overflows
    (``finite`` says it did not), as a GradScaler does for an ordinary step.

    >>> with_loss_scale(lambda scale: scale, lambda out: True)
    1.0
    """
    scale = INITIAL_LOSS_SCALE if fp16_autocast() else 1.0
    while True:
        out = run(scale)
        if scale <= 1.0 or finite(out):
            return out
        logger.debug("loss scale %g overflowed float16; retrying at %g", scale, scale / 16)
        scale = max(1.0, scale / 16)
