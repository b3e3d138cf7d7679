"""The functional entry point: per-sample gradients of a model on one batch, any backend."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from psg_core.backends.base import (check_rows, earliest_edges, get_grad_sample, set_grad_sample,
                                    trainable_parameters)
from psg_core.backends.hooks import GradSampleModule
from psg_core.errors import ConfigError
from psg_core.losses import LossFn, as_unreduced, per_sample_loss
from psg_core.modes import GradSampleMode, LossReduction, parse_enum

__all__ = ["PerSampleOutput", "per_sample_gradients", "compute_per_sample", "register_backend",
           "as_inputs", "batch_rows"]


@dataclass(frozen=True)
class PerSampleOutput:
    """Per-sample gradients of one batch and the loss they belong to."""

    #: ``{name: (N, *shape)}`` for every trainable parameter, named as in named_parameters().
    grads: dict[str, torch.Tensor]
    #: ``(N,)`` each sample's loss (detached).
    per_sample_losses: torch.Tensor
    num_samples: int


#: backend(module, args, targets, loss_fn, K=, reduction=, batch_first=) -> PerSampleOutput
Backend = Callable[..., PerSampleOutput]
_BACKENDS: dict[GradSampleMode, Backend] = {}


def register_backend(mode: GradSampleMode) -> Callable[[Backend], Backend]:
    """Internal: a backend module registers its functional implementation here."""
    def decorator(fn: Backend) -> Backend:
        _BACKENDS[mode] = fn
        return fn
    return decorator


def as_inputs(inputs: Any) -> tuple[Any, ...]:
    """Positional model arguments: a tensor becomes a 1-tuple; tuples and lists pass through."""
    return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)


def batch_rows(args: tuple[Any, ...], batch_dim: int, *, where: str) -> int:
    """Number of rows (N*K) of the first tensor argument along ``batch_dim``."""
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if first is None or first.dim() <= batch_dim:
        raise ConfigError(f"{where}: inputs must hold a tensor with a batch dimension {batch_dim}")
    return int(first.shape[batch_dim])


@register_backend(GradSampleMode.HOOKS)
def _hooks_backend(module: nn.Module, args: tuple[Any, ...], targets: torch.Tensor, loss_fn: LossFn,
                   *, K: int, reduction: LossReduction, batch_first: bool) -> PerSampleOutput:
    params = trainable_parameters(module)
    rows = batch_rows(args, 0 if batch_first else 1, where="per_sample_gradients")
    n_samples = check_rows(rows, K, where="per_sample_gradients")
    saved = {name: get_grad_sample(p) for name, p in params.items()}
    for p in params.values():
        set_grad_sample(p, None)
    # Backpropagating sum_n loss_n (each sample's loss already reduced over its K rows as asked)
    # gives every layer output gradients in per-sample scale: no rescaling of backprops.
    wrapped = GradSampleModule(module, batch_first=batch_first, loss_reduction=LossReduction.SUM,
                               strict=False, augmentation_multiplicity=K)
    try:
        with wrapped.recording_edges() as edges:
            per_element = loss_fn(wrapped(*args), targets)
        losses = per_sample_loss(per_element, num_samples=n_samples,
                                 batch_dim=0 if batch_first else 1, reduction=reduction)
        if edges and n_samples:
            # Gradients of the hooked layer outputs only: the hooks fill p.grad_sample, no p.grad
            # is computed (nor touched: the caller's stays as it was).
            torch.autograd.grad(losses.sum(), earliest_edges(edges), allow_unused=True)
        grads = {}
        for name, p in params.items():
            gs = get_grad_sample(p)
            grads[name] = gs if gs is not None else torch.zeros(n_samples, *p.shape, dtype=p.dtype,
                                                                 device=p.device)
    finally:
        wrapped.remove_hooks()
        for name, p in params.items():
            set_grad_sample(p, saved[name])
    return PerSampleOutput(grads=grads, per_sample_losses=losses.detach(), num_samples=n_samples)


def compute_per_sample(module: nn.Module, inputs: Any, targets: torch.Tensor, *,
                       loss_fn: LossFn | nn.Module, mode: GradSampleMode | str = GradSampleMode.HOOKS,
                       augmentation_multiplicity: int = 1,
                       loss_reduction: LossReduction | str = LossReduction.MEAN,
                       batch_first: bool = True) -> PerSampleOutput:
    """Like :func:`per_sample_gradients`, also returning each sample's loss."""
    mode = GradSampleMode(parse_enum(GradSampleMode, mode, what="per_sample_gradients: mode"))
    reduction = LossReduction(parse_enum(LossReduction, loss_reduction,
                                         what="per_sample_gradients: loss_reduction"))
    K = augmentation_multiplicity
    if isinstance(K, bool) or not isinstance(K, int) or K < 1:
        raise ConfigError(f"per_sample_gradients: augmentation_multiplicity must be an int >= 1, got {K!r}")
    backend = _BACKENDS.get(mode)
    if backend is None:
        raise ConfigError(f"per_sample_gradients: mode {mode.value!r} does not materialise per-sample "
                          "gradients; use psg_core.dp_gradient for the clipped sum")
    return backend(module, as_inputs(inputs), targets, as_unreduced(loss_fn), K=K, reduction=reduction,
                   batch_first=batch_first)


def per_sample_gradients(module: nn.Module, inputs: Any, targets: torch.Tensor, *,
                         loss_fn: LossFn | nn.Module, mode: GradSampleMode | str = GradSampleMode.HOOKS,
                         augmentation_multiplicity: int = 1,
                         loss_reduction: LossReduction | str = LossReduction.MEAN,
                         batch_first: bool = True) -> dict[str, torch.Tensor]:
    """Per-sample gradients of ``module`` on one batch.

    Args:
        module: the model; it is not modified (``p.grad`` and ``p.grad_sample`` are left as they were).
        inputs: a tensor or a tuple of positional arguments; ``N*K`` rows on the batch dimension,
            sample-major (rows ``n*K .. n*K+K-1`` are the K augmented copies of sample n).
        targets: ``N*K`` rows, same layout.
        loss_fn: ``loss_fn(outputs, targets)`` returning the unreduced loss (a torch loss module
            of any reduction is accepted too; see :mod:`psg_core.losses`).
        mode: ``"hooks"``, ``"functorch"`` or ``"ew"`` (``"ghost"`` never materialises them).
        augmentation_multiplicity: K.
        loss_reduction: ``"mean"`` (grad of each sample's mean loss over its K copies) or ``"sum"``.
        batch_first: batch on dimension 0 (True) or 1.

    Returns:
        ``{name: (N, *param.shape)}`` for every trainable parameter, keyed as in
        ``module.named_parameters()``.

    >>> import torch
    >>> grads = per_sample_gradients(nn.Linear(3, 2), torch.randn(8, 3), torch.randn(8, 2),
    ...                              loss_fn=nn.MSELoss(), augmentation_multiplicity=2)
    >>> grads["weight"].shape
    torch.Size([4, 2, 3])
    """
    return compute_per_sample(module, inputs, targets, loss_fn=loss_fn, mode=mode,
                              augmentation_multiplicity=augmentation_multiplicity,
                              loss_reduction=loss_reduction, batch_first=batch_first).grads


# Backend modules register themselves in _BACKENDS on import (they import this module, hence last).
from psg_core.backends import functorch as _functorch  # noqa: E402,F401
from psg_core.backends import ew as _ew  # noqa: E402,F401
