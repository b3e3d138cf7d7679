"""Small tensor helpers shared by the grad samplers."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

import torch

if TYPE_CHECKING:  # typing.TypeIs is Python 3.13+; torch depends on typing_extensions anyway
    from typing_extensions import TypeIs

__all__ = ["wants_grad", "accumulating_into", "accumulation_target", "adds_into_targets", "takes_targets"]


def wants_grad(param: torch.Tensor | None) -> TypeIs[torch.Tensor]:
    """True for a parameter that exists and is trainable (narrows ``Tensor | None`` for mypy)."""
    return param is not None and param.requires_grad


class _Targets(threading.local):
    def __init__(self) -> None:
        self.by_param: dict[int, torch.Tensor] = {}


_TARGETS = _Targets()


_F = TypeVar("_F", bound=Callable[..., Any])


def adds_into_targets(fn: _F) -> _F:
    """Marks a grad sampler that consults :func:`accumulation_target` (and returns the target it
    added into): only such a sampler, called as the layer's own, is offered targets. A sampler that
    calls one of them for a part of its result (a custom layer's, say) is not, so the part it is
    given back never already holds another call's gradient."""
    fn._psg_adds_into_targets = True  # type: ignore[attr-defined]
    return fn


def takes_targets(fn: Callable[..., Any] | None) -> bool:
    """Whether ``fn`` was marked by :func:`adds_into_targets`."""
    return bool(getattr(fn, "_psg_adds_into_targets", False))


@contextmanager
def accumulating_into(targets: dict[int, torch.Tensor]) -> Iterator[None]:
    """Offers the grad samplers called inside it ``targets``: by ``id(param)``, the ``(N,
    *param.shape)`` per-sample gradient of ``param`` that their result will be added to (a weight
    shared by several layers, GPT-2's token table and LM head: the second owner's sampler may add
    its gradient into the first's tensor in place, see :func:`accumulation_target`). On this
    thread only; nested offers replace the outer ones while they last.

    >>> weight, total = torch.zeros(3), torch.ones(2, 3)
    >>> with accumulating_into({id(weight): total}):
    ...     accumulation_target(weight, (2, 3), torch.float32, total.device) is total
    True
    >>> accumulation_target(weight, (2, 3), torch.float32, total.device) is None  # (outside it)
    True
    """
    saved = _TARGETS.by_param
    _TARGETS.by_param = targets
    try:
        yield
    finally:
        _TARGETS.by_param = saved


def accumulation_target(param: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype,
                        device: torch.device) -> torch.Tensor | None:
    """The contiguous ``shape`` tensor of ``dtype`` on ``device`` offered for ``param`` by
    :func:`accumulating_into`, or None. A sampler that takes it adds its per-sample gradient into
    it (nothing else: it holds another layer's part) and returns it as ``param``'s result; the
    caller then knows the sum is made. A sampler that does not simply returns its own tensor."""
    target = _TARGETS.by_param.get(id(param)) if _TARGETS.by_param else None
    if target is None or tuple(target.shape) != tuple(shape) or target.dtype != dtype \
            or target.device != device or not target.is_contiguous():
        return None
    return target
