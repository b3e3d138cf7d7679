"""Grad samplers and ghost norms, one module per layer family; importing this package registers them all."""

from __future__ import annotations

from psg_core.grad_sample import conv as _conv  # noqa: F401
from psg_core.grad_sample import embedding as _embedding  # noqa: F401
from psg_core.grad_sample import linear as _linear  # noqa: F401  (registers)
from psg_core.grad_sample import norms as _norms  # noqa: F401
from psg_core.grad_sample import sequence_bias as _sequence_bias  # noqa: F401
from psg_core.grad_sample.ghost_norm import (GHOST_NORMS, GhostFactors, GhostNormRegistry, WeightLayout,
                                             register_ghost_norm)
from psg_core.grad_sample.registry import (GRAD_SAMPLERS, GradSampler, GradSamplerRegistry,
                                           register_grad_sampler)

__all__ = ["GHOST_NORMS", "GRAD_SAMPLERS", "GhostFactors", "GhostNormRegistry", "GradSampler",
           "GradSamplerRegistry", "WeightLayout", "register_ghost_norm", "register_grad_sampler"]
