"""The functional entry point: per-sample gradients of a model on one batch, any backend.

The backends are registered in one place (:mod:`psg_core.backends.registry`); those that
materialise per-sample gradients follow :data:`psg_core.backends.base.PerSampleBackend`. The batch
layout is validated once, here.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from psg_core.backends.base import PerSampleOutput, empty_output, trainable_parameters
from psg_core.backends.registry import BACKENDS
from psg_core.errors import ConfigError
from psg_core.layout import BatchLayout, ModelInputs
from psg_core.losses import LossFn, as_unreduced
from psg_core.modes import GradSampleMode, LossReduction, parse_enum
from psg_core.precision import as_dtype, at_least_single, no_autocast, with_loss_scale
from psg_core.support import exclusive, one_walk

__all__ = ["PerSampleOutput", "per_sample_gradients", "compute_per_sample", "BACKENDS"]

def compute_per_sample(module: nn.Module, inputs: Any, targets: torch.Tensor, *,
                       loss_fn: LossFn | nn.Module, mode: GradSampleMode | str = GradSampleMode.HOOKS,
                       augmentation_multiplicity: int = 1,
                       loss_reduction: LossReduction | str = LossReduction.MEAN,
                       batch_first: bool = True, layout: BatchLayout | None = None) -> PerSampleOutput:
    """Like :func:`per_sample_gradients`, also returning each sample's loss.

    ``layout`` is the batch layout when the caller validated it already (``dp_gradient`` does).
    """
    where = "per_sample_gradients"
    mode = GradSampleMode(parse_enum(GradSampleMode, mode, what=f"{where}: mode"))
    reduction = LossReduction(parse_enum(LossReduction, loss_reduction, what=f"{where}: loss_reduction"))
    backend = BACKENDS[mode].per_sample
    if backend is None:
        raise ConfigError(f"{where}: mode {mode.value!r} does not materialise per-sample "
                          "gradients; use psg_core.dp_gradient for the clipped sum")
    model_inputs = ModelInputs.parse(inputs, where=where)
    if layout is None:
        layout = BatchLayout.of_call(model_inputs, targets, augmentation_multiplicity=augmentation_multiplicity,
                                     batch_first=batch_first, where=where)
    # One thread at a time on a model, its parameter list read inside too (another thread's ew call
    # has ExpandedWeights standing in for them): see psg_core.support.exclusive. The call's checks,
    # hooks and parameter lists share one walk of the tree (as dp_gradient's do).
    with exclusive(module), one_walk(module):
        if layout.num_samples == 0:
            return empty_output(trainable_parameters(module))
        return _compute(module, model_inputs, targets, as_unreduced(loss_fn), backend, layout, reduction)


def _compute(module: nn.Module, model_inputs: ModelInputs, targets: torch.Tensor, unreduced: LossFn,
             backend: Any, layout: BatchLayout, reduction: LossReduction) -> PerSampleOutput:
    params = trainable_parameters(module)

    def run(scale: float, pending: torch.Tensor | None) -> PerSampleOutput:
        # (every sample is computed again: a backend's results are per sample, merged below)
        def scaled(outputs: Any, y: torch.Tensor) -> torch.Tensor:
            # in float32 at least: a float16 loss times the scale would overflow (the gradient
            # reaching it, the scale itself at most, is representable: see INITIAL_LOSS_SCALE)
            return at_least_single(unreduced(outputs, y)) * scale

        out = backend(module, model_inputs, targets, unreduced if scale == 1.0 else scaled, layout=layout,
                      reduction=reduction)
        # Each parameter's per-sample gradients in its own dtype (psg_core.precision), unscaled.
        if scale == 1.0:  # (no autocast loss scale: nothing to divide, on every step)
            return PerSampleOutput(grads={name: as_dtype(g, params[name].dtype) for name, g in out.grads.items()},
                                   per_sample_losses=out.per_sample_losses, num_samples=out.num_samples)
        with no_autocast():  # (dividing by a power of two: the losses are exactly the unscaled ones)
            return PerSampleOutput(grads={name: (g / scale).to(params[name].dtype) for name, g in out.grads.items()},
                                   per_sample_losses=out.per_sample_losses / scale, num_samples=out.num_samples)

    def finite(out: PerSampleOutput) -> torch.Tensor:
        """``(N,)``: the samples whose gradient is finite in every parameter."""
        rows = [torch.isfinite(g.reshape(out.num_samples, -1)).all(1) for g in out.grads.values()]
        return torch.stack(rows).all(0) if rows else torch.ones(out.num_samples, dtype=torch.bool,
                                                                 device=out.per_sample_losses.device)

    def merge(kept: PerSampleOutput, new: PerSampleOutput, take: torch.Tensor) -> PerSampleOutput:
        """``kept`` with the ``take`` samples' gradients from ``new`` (losses are unscaled in both)."""
        return PerSampleOutput(grads={name: torch.where(take.view(-1, *[1] * (g.dim() - 1)), new.grads[name], g)
                                      for name, g in kept.grads.items()},
                               per_sample_losses=kept.per_sample_losses, num_samples=kept.num_samples)

    return with_loss_scale(run, finite, merge)


def per_sample_gradients(module: nn.Module, inputs: Any, targets: torch.Tensor, *,
                         loss_fn: LossFn | nn.Module, mode: GradSampleMode | str = GradSampleMode.HOOKS,
                         augmentation_multiplicity: int = 1,
                         loss_reduction: LossReduction | str = LossReduction.MEAN,
                         batch_first: bool = True) -> dict[str, torch.Tensor]:
    """Per-sample gradients of ``module`` on one batch.

    Args:
        module: the model; it is not modified (``p.grad`` and ``p.grad_sample`` are left as they were).
            psg's calls on one model from several threads run one at a time (a lock per model).
        inputs: a tensor, a tuple of positional arguments, or a mapping of keyword arguments
            (``{"input_ids": ..., "attention_mask": ...}``); the batch tensors have ``N*K`` rows on
            the batch dimension, sample-major (rows ``n*K .. n*K+K-1`` are the K augmented copies
            of sample n). Other tensors (broadcast position ids, ...) are batch-free: psg follows
            which tensors carry the batch through the forward pass.
        targets: ``N*K`` rows, same layout (their batch dimension is the layout's when they have
            it, else 0); they define N*K.
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
