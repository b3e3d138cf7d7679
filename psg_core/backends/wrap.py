"""``wrap_model``: one entry point for the four per-sample gradient wrappers."""

from __future__ import annotations

from typing import Any

from torch import nn

from psg_core.backends.base import AbstractGradSampleModule
from psg_core.backends.registry import BACKENDS
from psg_core.errors import ConfigError
from psg_core.modes import GradSampleMode, parse_enum

__all__ = ["wrap_model"]

_COMMON = {"batch_first", "loss_reduction", "augmentation_multiplicity"}


def wrap_model(module: nn.Module, mode: GradSampleMode | str = GradSampleMode.HOOKS,
               **kwargs: Any) -> AbstractGradSampleModule:
    """Wraps ``module`` for per-sample gradients with the backend ``mode``.

    Args:
        module: the model.
        mode: ``"hooks"`` (:class:`~psg_core.GradSampleModule`), ``"functorch"`` (the same wrapper
            with every layer computed by ``torch.func``, ``force_functorch=True``), ``"ew"``
            (:class:`~psg_core.backends.ew.ExpandedWeightsGradSampleModule`) or ``"ghost"``
            (:class:`~psg_core.backends.ghost.GhostClippingModule`, which computes clipped sums
            with ``.dp_gradient(...)`` and never sets ``p.grad_sample``).
        **kwargs: ``batch_first``, ``loss_reduction``, ``augmentation_multiplicity`` for every
            mode; ``strict`` (hooks; accepted and meaningless elsewhere, since the other backends
            have no per-layer registry to be strict about), ``force_functorch`` (hooks only), and
            for ghost ``max_grad_norm``, ``clipping``, ``per_layer_max_grad_norms``.

    Returns:
        An :class:`~psg_core.backends.base.AbstractGradSampleModule`.

    >>> import torch
    >>> model = wrap_model(nn.Linear(3, 2), "ew", augmentation_multiplicity=2)
    >>> model(torch.randn(4, 3)).sum().backward()
    >>> model.weight.grad_sample.shape
    torch.Size([2, 2, 3])
    """
    parsed = GradSampleMode(parse_enum(GradSampleMode, mode, what="wrap_model: mode"))
    backend = BACKENDS[parsed]
    unknown = sorted(set(kwargs) - _COMMON - backend.options)
    if unknown:
        raise ConfigError(f"wrap_model: mode {parsed.value!r} does not take {', '.join(unknown)}; it takes "
                          f"{', '.join(sorted(_COMMON | backend.options))}")
    return backend.wrapper(module, **kwargs)
