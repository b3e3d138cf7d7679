"""The one call a worker makes: per-sample gradients -> norms -> clip -> sum (no noise)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from psg_core.api import compute_per_sample
from psg_core.backends.base import trainable_parameters
from psg_core.backends.registry import BACKENDS
from psg_core._host import capturing, host_float
from psg_core.clipping import clip_and_sum, dropped_samples, kept_sum
from psg_core.config import DPConfig, DPGradient
from psg_core.errors import ConfigError, NonFiniteInputError
from psg_core.layout import BatchLayout, ModelInputs
from psg_core.losses import LossFn
from psg_core.modes import Clipping, GradSampleMode
from psg_core.precision import as_dtype, no_autocast
from psg_core.support import exclusive, one_walk

__all__ = ["dp_gradient", "l2_sensitivity"]


def _check_finite(inputs: ModelInputs, targets: torch.Tensor) -> None:
    leaves = inputs.leaves()
    for what, tensors in (("inputs", leaves), ("targets", [targets])):
        for leaf in tensors:
            if isinstance(leaf, torch.Tensor) and (leaf.is_floating_point() or leaf.is_complex()):
                # The sum is finite when every value is (one pass, one read), but for an overflow of
                # the sum itself; only then are the values counted.
                total = leaf.sum()
                if bool(torch.isfinite(total)) if total.is_complex() else math.isfinite(total.item()):
                    continue
                bad = int((~torch.isfinite(leaf)).sum().item())
                if bad:
                    raise NonFiniteInputError(
                        f"dp_gradient: {what} contain NaN or infinity ({bad} of {leaf.numel()} values "
                        f"in a tensor of shape {tuple(leaf.shape)})")


def l2_sensitivity(config: DPConfig) -> float:
    """The L2 bound on one sample's clipped contribution, which the noise std multiplies.

    ``max_grad_norm`` for flat and automatic clipping and for per_layer clipping with the default
    bounds; ``sqrt(sum_i C_i^2)`` for per_layer clipping with explicit bounds ``C_i``.

    >>> l2_sensitivity(DPConfig(clipping="per_layer", per_layer_max_grad_norms=(3.0, 4.0)))
    5.0
    """
    if config.clipping is Clipping.PER_LAYER and config.per_layer_max_grad_norms is not None:
        return math.sqrt(sum(c * c for c in config.per_layer_max_grad_norms))
    return config.max_grad_norm


def _empty(params: dict[str, nn.Parameter]) -> DPGradient:
    device = next(iter(params.values())).device
    return DPGradient(grads={name: torch.zeros_like(p, memory_format=torch.contiguous_format).detach()
                             for name, p in params.items()},
                      per_sample_norms=torch.zeros(0, dtype=torch.float32, device=device),
                      loss_sum=0.0, num_samples=0, num_clipped=0)


def dp_gradient(module: nn.Module, inputs: Any, targets: torch.Tensor, *, loss_fn: LossFn | nn.Module,
                config: DPConfig) -> DPGradient:
    """Sum over samples of clipped per-sample gradients of ``module`` on one batch (no noise).

    Args:
        module: the model; its parameters and their ``p.grad`` are not modified (buffers that its
            forward updates, such as running statistics, are updated as by any forward call,
            except under ``mode="functorch"``, which refuses in-place buffer updates). psg's calls
            on one model from several threads run one at a time (a lock per model).
        inputs: a tensor, a tuple of positional arguments or a mapping of keyword arguments; the
            batch tensors have ``N*K`` rows on the batch dimension, sample-major (rows
            ``n*K .. n*K+K-1`` are the K copies of sample n).
        targets: ``N*K`` rows, same layout.
        loss_fn: ``loss_fn(outputs, targets)`` returning the unreduced loss (a torch loss module of
            any reduction is accepted, see :mod:`psg_core.losses`).
        config: backend, K, reduction, layout and clipping (its ``noise_multiplier`` is not used
            here: noise is added once per step, after shard results are merged).

    Returns:
        :class:`~psg_core.config.DPGradient`: ``grads`` keyed as ``named_parameters()`` (trainable
        only), fp32 ``per_sample_norms`` ``(N,)`` before clipping, the sum of per-sample losses,
        N and the number clipped. N = 0 gives zero gradients.

    Raises:
        NonFiniteInputError: a floating input or target holds NaN or infinity.
        BatchLayoutError: the number of rows is not divisible by K.

    >>> model = nn.Linear(3, 1)
    >>> out = dp_gradient(model, torch.randn(8, 3), torch.randn(8, 1), loss_fn=nn.MSELoss(),
    ...                   config=DPConfig(max_grad_norm=0.1, augmentation_multiplicity=2))
    >>> out.num_samples, out.per_sample_norms.shape, bool(out.grads["weight"].norm() <= 4 * 0.1)
    (4, torch.Size([4]), True)
    """
    if not isinstance(config, DPConfig):
        raise ConfigError(f"dp_gradient: config must be a DPConfig, got {type(config).__name__}")
    if not isinstance(module, nn.Module):
        raise ConfigError(f"dp_gradient: expected an nn.Module, got {type(module).__name__}")
    # one thread at a time on a model (support.exclusive); the step's checks, hooks and parameter
    # lists share one walk of the tree
    with exclusive(module), one_walk(module):
        model_inputs = ModelInputs.parse(inputs, where="dp_gradient")
        if not isinstance(targets, torch.Tensor):
            raise ConfigError(f"dp_gradient: targets must be a tensor, got {type(targets).__name__}")
        if not capturing():  # (a recorded step's caller checks each batch before its replay)
            _check_finite(model_inputs, targets)
        params = trainable_parameters(module)
        if not params:
            raise ConfigError("dp_gradient: the module has no trainable parameters")
        layout = BatchLayout.of_call(model_inputs, targets, augmentation_multiplicity=config.augmentation_multiplicity,
                                     batch_first=config.batch_first, where="dp_gradient")
        if layout.num_samples == 0:
            return _empty(params)

        own_sum = BACKENDS[config.mode].dp_gradient
        if own_sum is not None:  # ghost: norms and the clipped sum without per-sample gradients
            result = own_sum(module, model_inputs, targets, loss_fn=loss_fn, config=config, layout=layout)
            result.per_sample_norms = as_dtype(result.per_sample_norms, torch.float32)
            return result

        out = compute_per_sample(module, model_inputs, targets, loss_fn=loss_fn, mode=config.mode,
                                 augmentation_multiplicity=config.augmentation_multiplicity,
                                 loss_reduction=config.loss_reduction, batch_first=config.batch_first,
                                 layout=layout)
        with no_autocast():  # norms in fp32, sums in the parameters' precision (psg_core.precision)
            clipped = clip_and_sum(out.grads, max_grad_norm=config.max_grad_norm, clipping=config.clipping,
                                   per_layer_max_grad_norms=config.per_layer_max_grad_norms)
        dropped = dropped_samples(clipped.per_sample_norms)
        return DPGradient(grads={name: g.to(params[name].dtype) for name, g in clipped.grads.items()},
                          per_sample_norms=clipped.per_sample_norms,
                          loss_sum=host_float(kept_sum(out.per_sample_losses, dropped)), num_samples=out.num_samples,
                          num_clipped=clipped.num_clipped, num_dropped=clipped.num_dropped)
