"""Loss handling shared by every backend.

A psg ``loss_fn(outputs, targets)`` returns the *unreduced* loss: one value per element, with the
batch on the model's batch dimension (e.g. ``nn.CrossEntropyLoss(reduction="none")``). psg reduces
it itself, per batch (``loss_reduction``) and per sample (over the sample's K rows), so that every
backend agrees on what "sample n's loss" is. For convenience a torch loss module
(``nn.MSELoss()``, ...) is accepted whatever its ``reduction``: psg uses a copy with
``reduction="none"``. With class ``weight`` or ``ignore_index`` that copy's elements are already
weighted (0 for an ignored one), and psg's mean divides by the element count, not by the weights'
sum: torch's weighted batch mean up to one factor for the whole batch, not each sample's own
weighted mean (a ``loss_fn`` that wants that returns it per row itself).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from psg_core.errors import BatchLayoutError, ConfigError
from psg_core.modes import LossReduction

__all__ = ["LossFn", "as_unreduced", "reduce_loss", "per_sample_loss", "loss_batch_dim"]

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]


def as_unreduced(loss_fn: LossFn | nn.Module) -> LossFn:
    """Returns a loss function producing per-element losses (see module docstring)."""
    if isinstance(loss_fn, nn.modules.loss._Loss):
        if loss_fn.reduction != "none":
            loss_fn = copy.copy(loss_fn)
            loss_fn.reduction = "none"
        return loss_fn
    if not callable(loss_fn):
        raise ConfigError(f"loss_fn: expected a callable, got {type(loss_fn).__name__}")
    return loss_fn


def reduce_loss(per_element: torch.Tensor, reduction: LossReduction) -> torch.Tensor:
    """The batch loss: mean or sum over every element of the unreduced loss."""
    return per_element.mean() if reduction is LossReduction.MEAN else per_element.sum()


def loss_batch_dim(per_element: torch.Tensor, batch_dim: int, followed: int | None = None) -> int:
    """The batch axis of an unreduced loss: where the forward pass put it (``followed``, from
    :class:`psg_core.provenance.BatchTracker`), else the layout's when the loss has it, else 0."""
    if followed is not None and followed >= 0:
        return followed
    return batch_dim if per_element.dim() > batch_dim else 0


def per_sample_loss(per_element: torch.Tensor, *, num_samples: int, batch_dim: int,
                    reduction: LossReduction) -> torch.Tensor:
    """``(N,)``: each sample's loss, the reduction over its K rows (and their other elements)."""
    if per_element.dim() == 0:
        raise ConfigError("loss_fn: returned a scalar; it must return the unreduced loss "
                          "(e.g. nn.CrossEntropyLoss(reduction='none'))")
    if per_element.dim() == 1 and per_element.shape[0] == num_samples:
        return per_element  # one number per sample already (K = 1): its own mean and sum
    rows_first = per_element.movedim(batch_dim, 0) if batch_dim else per_element  # (N*K, ...)
    if num_samples and rows_first.shape[0] % num_samples:
        raise BatchLayoutError(
            f"loss_fn: the unreduced loss has shape {tuple(per_element.shape)}, whose dimension "
            f"{batch_dim} ({rows_first.shape[0]}) does not hold the batch's {num_samples} samples; it "
            "must keep the batch's rows (N*K) on the batch dimension, or rows of the batch flattened "
            "with the batch outermost")
    if num_samples == 0:
        return rows_first.new_zeros(0)
    grouped = rows_first.reshape(num_samples, -1)  # (N, K * elements)
    return grouped.mean(1) if reduction is LossReduction.MEAN else grouped.sum(1)
