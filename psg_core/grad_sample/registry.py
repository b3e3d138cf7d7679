"""The grad-sampler registry: which function computes per-sample gradients for which layer type."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from psg_core.errors import ConfigError
from psg_core.grad_sample._type_registry import LayerKey, LayerTypeRegistry
from psg_core.layout import fold_rows

__all__ = ["GradSampler", "GradSamplerEntry", "GradSamplerRegistry", "GRAD_SAMPLERS", "RowCounter",
           "register_grad_sampler"]

#: ``fn(layer, activations, backprops, K) -> {parameter: (N, *parameter.shape)}``; the K argument
#: may be absent (an Opacus-style sampler), in which case it returns ``(N*K, *shape)`` and the
#: wrapper folds it over K. The keys are the layer's parameters, typed ``torch.Tensor`` because
#: that is what torch declares ``layer.weight`` and ``layer.bias`` to be.
GradSampler = Callable[..., dict[torch.Tensor, torch.Tensor]]

#: ``count_rows(layer, args, kwargs) -> int | None``: a call's N*K rows when they are not its first
#: tensor argument's batch size (None: they are).
RowCounter = Callable[[Any, tuple[Any, ...], dict[str, Any]], int | None]

_Sampler = TypeVar("_Sampler", bound=GradSampler)


@dataclass(frozen=True)
class GradSamplerEntry:
    """A registered sampler and how to call it (the options of :func:`register_grad_sampler`)."""

    fn: GradSampler
    #: the sampler takes K and folds the copies itself; else its per-row output is folded here.
    k_aware: bool
    layer_type: type[nn.Module]
    #: torch fixes the layer's batch at dim 0 whatever the model's layout (convolutions,
    #: GroupNorm, EmbeddingBag).
    batch_first_only: bool = False
    #: counts a call's rows when they are not the first tensor argument's batch size.
    row_counter: RowCounter | None = None
    #: the sampler also receives the call's keyword arguments (``kwargs=``, as given).
    with_kwargs: bool = False

    def count_rows(self, layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
        """The call's N*K rows when the sampler defines them, else None."""
        return None if self.row_counter is None else self.row_counter(layer, args, kwargs)

    def compute(self, layer: nn.Module, args: Sequence[Any], kwargs: dict[str, Any],
                backprops: torch.Tensor, augmentation_multiplicity: int,
                batch_dim: int) -> dict[torch.Tensor, torch.Tensor]:
        """Runs the sampler on one call: moves the batch to dim 0 and folds per-row results over K."""
        K = augmentation_multiplicity
        activations = [a.movedim(batch_dim, 0) if isinstance(a, torch.Tensor) and batch_dim else a
                       for a in args]
        if batch_dim:
            backprops = backprops.movedim(batch_dim, 0)
        # Keyword arguments arrive as given, in the model's layout.
        extra = {"kwargs": kwargs} if self.with_kwargs else {}
        if self.k_aware:
            return self.fn(layer, activations, backprops, K, **extra)
        # An Opacus-style sampler returns (N*K, ...) per row; fold it over the K copies.
        per_row = self.fn(layer, activations, backprops, **extra)
        return {p: fold_rows(g, K).sum(1) for p, g in per_row.items()}


def _takes_k(fn: GradSampler) -> bool:
    """Whether ``fn`` has the K parameter (for ``k_aware=None``): a fourth positional parameter,
    ``*args``, or one named ``K``."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # builtins without a signature: assume the classic form
        return False
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        return True
    positional = [p for p in params if p.kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                  inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 4 or any(p.name == "K" for p in params)


class GradSamplerRegistry(LayerTypeRegistry[GradSamplerEntry]):
    """Maps layer types to grad samplers; lookup walks the class MRO.

    A subclass inherits its base's sampler only while it keeps the base's ``forward``; one that
    overrides ``forward`` needs its own registration (or the torch.func fallback). A layer of an
    optional library may be registered by its dotted name, resolved once the library is imported.

    >>> registry = GradSamplerRegistry()
    >>> @registry.register(nn.Linear)
    ... def my_linear(layer, activations, backprops, K):
    ...     return {}
    >>> registry.lookup(nn.modules.linear.NonDynamicallyQuantizableLinear).fn is my_linear
    True
    """

    def __init__(self) -> None:
        super().__init__(what="grad sampler", decorator="register_grad_sampler")

    def register(self, *layer_types: LayerKey, replace: bool = False, k_aware: bool | None = None,
                 batch_first_only: bool = False, count_rows: RowCounter | None = None,
                 with_kwargs: bool = False) -> Callable[[_Sampler], _Sampler]:
        """Decorator registering ``fn`` for every type in ``layer_types``; see
        :func:`register_grad_sampler` for the options.

        Registering a type that already has a sampler raises :class:`ConfigError` unless
        ``replace=True``.
        """
        self.check_keys(layer_types)
        if k_aware is not None and not isinstance(k_aware, bool):
            raise ConfigError(f"register_grad_sampler: k_aware must be True, False or None, got {k_aware!r}")
        if count_rows is not None and not callable(count_rows):
            raise ConfigError(f"register_grad_sampler: count_rows must be callable, got {count_rows!r}")

        def decorator(fn: _Sampler) -> _Sampler:
            takes_k = _takes_k(fn) if k_aware is None else k_aware
            self.add(layer_types, lambda layer_type: GradSamplerEntry(
                fn, takes_k, layer_type, batch_first_only=bool(batch_first_only), row_counter=count_rows,
                with_kwargs=bool(with_kwargs)), replace=replace)
            return fn

        return decorator


#: The process-wide registry used by the hooks and ghost backends.
GRAD_SAMPLERS = GradSamplerRegistry()


def register_grad_sampler(*layer_types: LayerKey, replace: bool = False, k_aware: bool | None = None,
                          batch_first_only: bool = False, count_rows: RowCounter | None = None,
                          with_kwargs: bool = False) -> Callable[[_Sampler], _Sampler]:
    """Registers a per-sample gradient function for ``layer_types`` in the global registry.

    The function receives ``(layer, activations, backprops, K)`` with activations and backprops
    batch-first and ``N*K`` rows (sample-major), and returns ``{parameter: (N, *shape)}`` holding
    the gradient of each sample's *summed* loss over its K rows. A function without ``K`` (the
    Opacus signature) may return ``(N*K, *shape)``; the wrapper then sums over K.

    Args:
        layer_types: ``nn.Module`` subclasses, or dotted names ``"package.module.Class"`` of
            layers from a library psg_core does not import (resolved once the model imported it).
        replace: override an existing registration instead of raising :class:`ConfigError`.
        k_aware: whether ``fn`` takes K; ``None`` reads it from the signature (a fourth
            positional parameter or one named ``K``), so an Opacus-style sampler is accepted.
        batch_first_only: torch puts the layer's batch on dim 0 whatever the model's layout
            (convolutions, GroupNorm, EmbeddingBag).
        count_rows: ``count_rows(layer, args, kwargs) -> int | None``, the call's N*K rows when
            they are not the first tensor argument's batch size (EmbeddingBag with offsets).
        with_kwargs: ``fn`` also receives the call's keyword arguments as ``kwargs=``.

    >>> class Scale(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.weight = nn.Parameter(torch.ones(3))
    ...     def forward(self, x):
    ...         return x * self.weight
    >>> @register_grad_sampler(Scale, k_aware=True)
    ... def scale_grad_sample(layer, activations, backprops, K):
    ...     x = activations[0].reshape(-1, K, 3)
    ...     return {layer.weight: (x * backprops.reshape(-1, K, 3)).sum(1)}
    >>> GRAD_SAMPLERS.unregister(Scale)
    """
    return GRAD_SAMPLERS.register(*layer_types, replace=replace, k_aware=k_aware,
                                  batch_first_only=batch_first_only, count_rows=count_rows,
                                  with_kwargs=with_kwargs)
