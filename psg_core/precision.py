"""Precision policy: per-sample arithmetic in the parameters' precision, never in autocast's.

Under ``torch.autocast`` a layer's forward runs in bf16/fp16 while its parameters stay fp32, so
the gradients that reach a grad sampler are half precision and the activations it kept may be
either. psg computes per-sample gradients, norms and clipped sums from those in the parameters'
dtype (fp32 for an fp32 model), with autocast switched off, so that the clipping bound holds for
what is summed and every returned gradient has its parameter's dtype. A model whose parameters
are themselves bf16 or fp16 (no autocast) keeps computing per-sample gradients in that dtype; norms
and clipping factors are always fp32, and a clipped sum of half-precision gradients is multiplied
and accumulated in fp32 and cast to the parameters' dtype once (:func:`accumulation_dtype`: a
factor cast to fp16 is subnormal below ~6e-5 and 0 below ~6e-8, so the bound C would not hold).

Under fp16 autocast the backward pass runs on a scaled loss (:func:`with_loss_scale`), the loss
multiplied in fp32 (a float16 loss times the scale would overflow), each sample's result from the
highest scale at which it is finite.

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
           "with_loss_scale", "INITIAL_LOSS_SCALE", "accumulation_dtype", "at_least_single"]

#: The first loss scale tried under fp16 autocast (divided by 16 for the samples whose result is not
#: finite, see :func:`with_loss_scale`): the largest power of two float16 represents (65536 is not:
#: the gradient reaching a float16 loss, the scale itself for a sum, would be infinite on every
#: first pass).
INITIAL_LOSS_SCALE = 2.0 ** 15


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


_HALF = frozenset({torch.float16, torch.bfloat16})
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


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a weighted sum of ``dtype`` values (a clipped sum) is multiplied and accumulated
    in: float32 for half precision (a clipping factor below ~6e-5 is subnormal or 0 in float16, and
    bf16 keeps 8 bits of it), ``dtype`` itself otherwise. The sum is cast back to ``dtype`` once.

    >>> accumulation_dtype(torch.float16), accumulation_dtype(torch.float64)
    (torch.float32, torch.float64)
    """
    return torch.float32 if dtype in _HALF else dtype


def at_least_single(tensor: torch.Tensor) -> torch.Tensor:
    """A half-precision tensor in float32 (a float16 loss times a loss scale would overflow), any
    other unchanged."""
    return tensor.to(torch.float32) if tensor.dtype in _HALF else tensor


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


def with_loss_scale(run: Callable[[float, torch.Tensor | None], _T], finite: Callable[[_T], torch.Tensor],
                    merge: Callable[[_T, _T, torch.Tensor], _T]) -> _T:
    """The batch's result with the backward pass's loss multiplied by a loss scale, each sample's
    from the highest scale at which it is finite.

    Without fp16 autocast, ``run(1.0, None)`` once. Under it, small per-sample gradients would
    underflow float16, so the backward pass runs on the loss times ``INITIAL_LOSS_SCALE`` (2**15:
    the largest power of two float16 holds), and ``run`` divides its results by the scale. Where
    some samples' results overflow (``finite`` says which), the scale is divided by 16 (down to
    1) and ``run(scale, pending)`` is asked again for the ``(N,)`` bool ``pending`` samples only
    (those still without a finite result; ``run`` may compute the others too, or leave them out,
    as ghost clipping does, whose sums are over the batch); ``merge(kept, new, take)`` puts
    ``new``'s results of the ``take`` samples in place of ``kept``'s. Samples never finite, not
    even at scale 1, keep the first result: not finite, so clipping drops them (factor 0,
    counted in ``num_dropped``).

    Why per sample rather than the whole batch at one scale (as a GradScaler does for an
    ordinary step): a single sample whose gradient overflows at every scale (an outlier, an
    absurd loss weight) would drag the scale down to 1 for everyone, and the other samples'
    small gradients would underflow to exactly 0, unreported. Here every finite sample keeps
    its gradient from the highest scale it fits in, and an overflowing one is dropped and
    counted. A sample's result depends on its own values only (the scales tried are fixed, and
    the loop goes on while it is not finite), so DP's per-sample bound holds as for an fp32
    step: each kept sample is clipped to C, a dropped one contributes 0. The cost is one more
    pass per scale tried (at most 5) on a batch where something overflows; none otherwise.

    Args:
        run: ``run(scale, pending) -> result`` (``pending`` None: every sample).
        finite: ``(N,)`` bool of the samples whose result in ``run``'s answer is finite.
        merge: ``merge(kept, new, take)``.

    >>> with_loss_scale(lambda scale, pending: scale, lambda out: torch.tensor([True]), lambda k, n, t: n)
    1.0
    """
    scale = INITIAL_LOSS_SCALE if fp16_autocast() else 1.0
    out = run(scale, None)
    if scale <= 1.0:  # no loss scale, no read of the result (a recorded step takes this path)
        return out
    pending = ~finite(out)
    while scale > 1.0 and bool(pending.any()):
        if logger.isEnabledFor(logging.DEBUG):  # (the count is a read of the device)
            logger.debug("loss scale %g overflowed float16 for %d samples; retrying them at %g", scale,
                         int(pending.sum()), max(1.0, scale / 16))
        scale = max(1.0, scale / 16)
        new = run(scale, pending)
        take = pending & finite(new)
        if bool(take.any()):
            out = merge(out, new, take)
        pending = pending & ~take
    return out
