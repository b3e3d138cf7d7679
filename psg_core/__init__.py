"""psg_core: per-sample gradients for PyTorch with augmentation multiplicity.

>>> import torch
>>> from torch import nn
>>> import psg_core
>>> model = psg_core.GradSampleModule(nn.Linear(3, 1))
>>> model(torch.randn(5, 3)).sum().backward()
>>> model.weight.grad_sample.shape
torch.Size([5, 1, 3])
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from psg_core.api import per_sample_gradients
from psg_core.backends.base import AbstractGradSampleModule
from psg_core.backends.hooks import GradSampleModule
from psg_core.backends.wrap import wrap_model
from psg_core.clipping import ClipResult, clip_and_sum
from psg_core.config import DPConfig, DPGradient
from psg_core.dp import dp_gradient, l2_sensitivity
from psg_core.errors import (BatchLayoutError, BudgetExhaustedError, ConfigError,
                             GradAccumulationError, NonFiniteInputError, PsgError,
                             UnsupportedModuleError)
from psg_core.fix_model import fix_model
from psg_core.grad_sample import (GHOST_NORMS, GRAD_SAMPLERS, GhostFactors, GradSamplerRegistry, WeightLayout,
                                  register_ghost_norm, register_grad_sampler)
from psg_core.gemm import GemmKernel, gemm_kernel, set_gemm_kernel
from psg_core.native import NativeKernels, native_kernels, set_native_kernels
from psg_core.grad_sample.conv_strategy import ConvStrategy, conv_strategy, set_conv_strategy
from psg_core.layers import DPGRU, DPLSTM, DPRNN, DPMultiheadAttention
from psg_core.layout import batch_free
from psg_core.modes import Clipping, GradSampleMode, LossReduction
from psg_core.provenance import rowwise_module
from psg_core.support import unit_module
from psg_core.noise import add_noise, secure_generator
from psg_core.sampling import PoissonBatchSampler

__version__ = "0.1.0"

# The DP-SGD loop's names load on first use: privacy accounting pulls in dp-accounting (and scipy),
# ~1 s and ~80 MB that a worker, which only computes clipped sums, never needs.
_LAZY = {
    "AccountingMethod": "psg_core.accounting",
    "PrivacyAccountant": "psg_core.accounting",
    "GradientAccumulator": "psg_core.accumulate",
    "split_batch": "psg_core.accumulate",
    "QuantileClipping": "psg_core.adaptive_clipping",
    "calibrate_noise_multiplier": "psg_core.calibration",
    "steps_for_epochs": "psg_core.calibration",
    "DPStep": "psg_core.dp_step",
    "CapturedStep": "psg_core.capture",
}

if TYPE_CHECKING:
    from psg_core.accounting import AccountingMethod, PrivacyAccountant
    from psg_core.accumulate import GradientAccumulator, split_batch
    from psg_core.adaptive_clipping import QuantileClipping
    from psg_core.calibration import calibrate_noise_multiplier, steps_for_epochs
    from psg_core.capture import CapturedStep
    from psg_core.dp_step import DPStep


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'psg_core' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

__all__ = [
    "AbstractGradSampleModule",
    "AccountingMethod",
    "CapturedStep",
    "ClipResult",
    "DPStep",
    "GradientAccumulator",
    "PoissonBatchSampler",
    "PrivacyAccountant",
    "QuantileClipping",
    "add_noise",
    "batch_free",
    "calibrate_noise_multiplier",
    "clip_and_sum",
    "conv_strategy",
    "dp_gradient",
    "gemm_kernel",
    "native_kernels",
    "l2_sensitivity",
    "secure_generator",
    "set_conv_strategy",
    "set_gemm_kernel",
    "set_native_kernels",
    "split_batch",
    "unit_module",
    "steps_for_epochs",
    "wrap_model",
    "BatchLayoutError",
    "DPGRU",
    "DPLSTM",
    "DPMultiheadAttention",
    "DPRNN",
    "BudgetExhaustedError",
    "Clipping",
    "ConfigError",
    "ConvStrategy",
    "GemmKernel",
    "NativeKernels",
    "DPConfig",
    "DPGradient",
    "GHOST_NORMS",
    "GRAD_SAMPLERS",
    "GhostFactors",
    "GradAccumulationError",
    "GradSampleMode",
    "GradSampleModule",
    "GradSamplerRegistry",
    "LossReduction",
    "NonFiniteInputError",
    "PsgError",
    "UnsupportedModuleError",
    "WeightLayout",
    "fix_model",
    "per_sample_gradients",
    "register_ghost_norm",
    "register_grad_sampler",
]
