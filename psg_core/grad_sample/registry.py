"""The grad-sampler registry: which function computes per-sample gradients for which layer type."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from psg_core.errors import ConfigError

__all__ = ["GradSampler", "GradSamplerEntry", "GradSamplerRegistry", "GRAD_SAMPLERS",
           "register_grad_sampler"]

#: ``fn(layer, activations, backprops, K) -> {parameter: (N, *parameter.shape)}``; the K argument
#: may be absent (an Opacus-style sampler), in which case it returns ``(N*K, *shape)`` and the
#: wrapper folds it over K. The keys are the layer's parameters, typed ``torch.Tensor`` because
#: that is what torch declares ``layer.weight`` and ``layer.bias`` to be.
GradSampler = Callable[..., dict[torch.Tensor, torch.Tensor]]

_Sampler = TypeVar("_Sampler", bound=GradSampler)


@functools.cache
def _takes_kwargs(fn: GradSampler) -> bool:
    try:
        param = inspect.signature(fn).parameters.get("kwargs")
    except (TypeError, ValueError):
        return False
    return param is not None and param.kind is inspect.Parameter.KEYWORD_ONLY


@dataclass(frozen=True)
class GradSamplerEntry:
    """A registered sampler and how to call it.

    A sampler function may describe how torch calls its layer, through attributes set on it:

    * ``fn.always_batch_first = True``: torch fixes the layer's batch at dim 0 whatever the model's
      layout (convolutions, GroupNorm, EmbeddingBag).
    * ``fn.batch_rows(layer, args, kwargs) -> int | None``: the call's N*K rows when they are not
      the first tensor argument's batch size (EmbeddingBag with offsets: one row per bag).
    * a keyword-only ``kwargs`` parameter: the sampler also receives the call's keyword arguments.
    """

    fn: GradSampler
    k_aware: bool
    layer_type: type[nn.Module]

    @property
    def always_batch_first(self) -> bool:
        """Whether the layer's batch is dim 0 whatever the model's layout."""
        return bool(getattr(self.fn, "always_batch_first", False))

    def count_rows(self, layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
        """The call's N*K rows when the sampler defines them, else None."""
        count = getattr(self.fn, "batch_rows", None)
        return None if count is None else count(layer, args, kwargs)

    def compute(self, layer: nn.Module, args: Sequence[Any], kwargs: dict[str, Any],
                backprops: torch.Tensor, augmentation_multiplicity: int,
                batch_dim: int) -> dict[torch.Tensor, torch.Tensor]:
        """Runs the sampler on one call: moves the batch to dim 0 and folds per-row results over K."""
        K = augmentation_multiplicity
        activations = [a.movedim(batch_dim, 0) if isinstance(a, torch.Tensor) and batch_dim else a
                       for a in args]
        if batch_dim:
            backprops = backprops.movedim(batch_dim, 0)
        if self.k_aware:
            if _takes_kwargs(self.fn):  # keyword arguments arrive as given, in the model's layout
                return self.fn(layer, activations, backprops, K, kwargs=kwargs)
            return self.fn(layer, activations, backprops, K)
        # An Opacus-style sampler returns (N*K, ...) per row; fold it over the K copies.
        per_row = self.fn(layer, activations, backprops)
        return {p: g.reshape(g.shape[0] // K, K, *g.shape[1:]).sum(1) for p, g in per_row.items()}


def _takes_k(fn: GradSampler) -> bool:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # builtins without a signature: assume the classic form
        return False
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        return True
    positional = [p for p in params if p.kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                  inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 4 or any(p.name == "K" for p in params)


class GradSamplerRegistry:
    """Maps layer types to grad samplers; lookup walks the class MRO.

    A subclass inherits its base's sampler only while it keeps the base's ``forward``; one that
    overrides ``forward`` needs its own registration (or the torch.func fallback).

    >>> registry = GradSamplerRegistry()
    >>> @registry.register(nn.Linear)
    ... def my_linear(layer, activations, backprops, K):
    ...     return {}
    >>> registry.lookup(nn.modules.linear.NonDynamicallyQuantizableLinear).fn is my_linear
    True
    """

    def __init__(self) -> None:
        self._entries: dict[type[nn.Module], GradSamplerEntry] = {}

    def register(self, *layer_types: type[nn.Module], replace: bool = False
                 ) -> Callable[[_Sampler], _Sampler]:
        """Decorator registering ``fn`` for every type in ``layer_types``.

        Registering a type that already has a sampler raises :class:`ConfigError` unless
        ``replace=True``.
        """
        if not layer_types:
            raise ConfigError("register_grad_sampler: give at least one layer type")
        for layer_type in layer_types:
            if not (isinstance(layer_type, type) and issubclass(layer_type, nn.Module)):
                raise ConfigError(
                    f"register_grad_sampler: expected nn.Module subclasses, got {layer_type!r}")

        def decorator(fn: _Sampler) -> _Sampler:
            for layer_type in layer_types:
                if layer_type in self._entries and not replace:
                    raise ConfigError(
                        f"register_grad_sampler: {layer_type.__qualname__} already has a grad "
                        f"sampler ({self._entries[layer_type].fn.__qualname__}); pass replace=True "
                        "to override it")
            for layer_type in layer_types:
                self._entries[layer_type] = GradSamplerEntry(fn, _takes_k(fn), layer_type)
            return fn

        return decorator

    def unregister(self, layer_type: type[nn.Module]) -> None:
        """Removes the sampler registered for exactly ``layer_type`` (KeyError if none)."""
        del self._entries[layer_type]

    def lookup(self, layer: nn.Module | type[nn.Module]) -> GradSamplerEntry | None:
        """The sampler for ``layer`` (instance or type): its own type first, then its bases."""
        layer_type = layer if isinstance(layer, type) else type(layer)
        for klass in layer_type.__mro__:
            entry = self._entries.get(klass)
            if entry is not None:
                # A subclass that computes something else than the registered layer must not
                # inherit its sampler silently.
                return entry if layer_type.forward is entry.layer_type.forward else None
        return None

    def __contains__(self, layer: object) -> bool:
        return isinstance(layer, (nn.Module, type)) and self.lookup(layer) is not None  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[type[nn.Module]]:
        return iter(sorted(self._entries, key=lambda t: t.__qualname__))

    def __len__(self) -> int:
        return len(self._entries)


#: The process-wide registry used by the hooks and ghost backends.
GRAD_SAMPLERS = GradSamplerRegistry()


def register_grad_sampler(*layer_types: type[nn.Module], replace: bool = False
                          ) -> Callable[[_Sampler], _Sampler]:
    """Registers a per-sample gradient function for ``layer_types`` in the global registry.

    The function receives ``(layer, activations, backprops, K)`` with activations and backprops
    batch-first and ``N*K`` rows (sample-major), and returns ``{parameter: (N, *shape)}`` holding
    the gradient of each sample's *summed* loss over its K rows. A function without ``K`` (the
    Opacus signature) may return ``(N*K, *shape)``; the wrapper then sums over K.

    >>> class Scale(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.weight = nn.Parameter(torch.ones(3))
    ...     def forward(self, x):
    ...         return x * self.weight
    >>> @register_grad_sampler(Scale)
    ... def scale_grad_sample(layer, activations, backprops, K):
    ...     x = activations[0].reshape(-1, K, 3)
    ...     return {layer.weight: (x * backprops.reshape(-1, K, 3)).sum(1)}
    >>> GRAD_SAMPLERS.unregister(Scale)
    """
    return GRAD_SAMPLERS.register(*layer_types, replace=replace)
