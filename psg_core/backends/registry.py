"""The backends, registered in one place: one :class:`Backend` object per mode.

Each ``psg_core/backends/<mode>.py`` defines its pieces (a function that materialises per-sample
gradients, or its own clipped sum, and a wrapper class); this module puts them together, so
nothing registers itself by being imported and no backend imports the entry points that use it.

>>> sorted(mode.value for mode in BACKENDS)
['ew', 'functorch', 'ghost', 'hooks']
>>> BACKENDS[GradSampleMode.GHOST].per_sample is None
True
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from psg_core.backends.base import AbstractGradSampleModule, PerSampleBackend
from psg_core.backends.ew import ExpandedWeightsGradSampleModule, ew_per_sample
from psg_core.backends.functorch import functorch_per_sample
from psg_core.backends.ghost import GhostClippingModule, ghost_dp_gradient
from psg_core.backends.hooks import GradSampleModule, hooks_per_sample
from psg_core.config import DPGradient
from psg_core.modes import GradSampleMode

__all__ = ["Backend", "BACKENDS"]


@dataclass(frozen=True)
class Backend:
    """What one mode provides."""

    mode: GradSampleMode
    #: ``wrapper(module, **options)``: the :class:`AbstractGradSampleModule` of ``wrap_model``.
    wrapper: Callable[..., AbstractGradSampleModule]
    #: keyword options ``wrap_model`` accepts for this mode beside ``batch_first``,
    #: ``loss_reduction`` and ``augmentation_multiplicity``.
    options: frozenset[str]
    #: materialises per-sample gradients (:data:`~psg_core.backends.base.PerSampleBackend`);
    #: None for a mode that never does.
    per_sample: PerSampleBackend | None
    #: computes the clipped sum itself, ``fn(module, inputs, targets, *, loss_fn, config)``; None:
    #: ``dp_gradient`` clips the per-sample gradients with :func:`psg_core.clip_and_sum`.
    dp_gradient: Callable[..., DPGradient] | None = None


def _without_strict(build: Callable[..., AbstractGradSampleModule], **fixed: Any) -> Callable[..., AbstractGradSampleModule]:
    """A wrapper factory for a mode without a per-layer registry to be strict about: ``strict`` is
    accepted (so one call works for every mode) and has no effect."""
    def make(module: nn.Module, **options: Any) -> AbstractGradSampleModule:
        options.pop("strict", None)
        return build(module, **fixed, **options)
    return make


#: The one registry of backends.
BACKENDS: dict[GradSampleMode, Backend] = {
    GradSampleMode.HOOKS: Backend(GradSampleMode.HOOKS, GradSampleModule, frozenset({"strict", "force_functorch"}),
                                  hooks_per_sample),
    GradSampleMode.FUNCTORCH: Backend(GradSampleMode.FUNCTORCH, _without_strict(GradSampleModule, force_functorch=True),
                                      frozenset({"strict"}), functorch_per_sample),
    GradSampleMode.EW: Backend(GradSampleMode.EW, _without_strict(ExpandedWeightsGradSampleModule),
                               frozenset({"strict"}), ew_per_sample),
    GradSampleMode.GHOST: Backend(GradSampleMode.GHOST, _without_strict(GhostClippingModule),
                                  frozenset({"strict", "max_grad_norm", "clipping", "per_layer_max_grad_norms"}),
                                  None, ghost_dp_gradient),
}
