"""Per-sample gradients of the normalisation layers that do not mix samples.

Each layer computes ``y = x_hat * weight + bias`` where ``x_hat`` is its input normalised with
statistics of that row alone, so ``weight`` gets ``sum g * x_hat`` and ``bias`` gets ``sum g``,
summed over the K copies and every axis that is not a feature axis. ``x_hat`` is recomputed from
the stored activation with torch's own functional op and the layer's ``eps``, so it is the
normalisation the forward pass used; GroupNorm's sums come from torch's own GroupNorm
weight-gradient kernel instead (no ``x_hat`` buffer, see :func:`_group_norm_by_kernel`).

GroupNorm and InstanceNorm take ``(N*K, C, *)`` inputs whatever the model's layout (torch fixes
their batch at dim 0); LayerNorm and RMSNorm follow the model's ``batch_first``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from psg_core.errors import UnsupportedModuleError
from psg_core.grad_sample._utils import wants_grad
from psg_core.grad_sample.registry import register_grad_sampler

__all__ = ["layer_norm_grad_sample", "rms_norm_grad_sample", "group_norm_grad_sample",
           "instance_norm_grad_sample", "batch_norm_grad_sample"]


def _trailing_affine_grads(weight: nn.Parameter | None, bias: nn.Parameter | None,
                           x_hat: torch.Tensor, backprops: torch.Tensor, feature_shape: tuple[int, ...],
                           K: int) -> dict[torch.Tensor, torch.Tensor]:
    """Grads of an affine map over the trailing ``feature_shape`` dims (LayerNorm, RMSNorm)."""
    features = math.prod(feature_shape)
    n_samples = backprops.shape[0] // K
    rows_per_sample = K * (math.prod(backprops.shape[1:]) // features)  # K*T
    g = backprops.reshape(n_samples, rows_per_sample, features)  # (N, K*T, P)
    out: dict[torch.Tensor, torch.Tensor] = {}
    if wants_grad(weight):
        # A product then a sum over the sample's K*T rows: an einsum contracting those rows keeps
        # the feature axis as a batch axis and has to transpose both operands first.
        weighted = backprops * x_hat  # (N*K, *, *S)
        out[weight] = weighted.reshape(n_samples, rows_per_sample, features).sum(1).reshape(
            n_samples, *feature_shape)  # (N, *S)
    if wants_grad(bias):
        out[bias] = g.sum(1).reshape(n_samples, *feature_shape)  # (N, *S)
    return out


def _channel_affine_grads(weight: nn.Parameter | None, bias: nn.Parameter | None,
                          x_hat: torch.Tensor, backprops: torch.Tensor,
                          K: int) -> dict[torch.Tensor, torch.Tensor]:
    """Grads of a per-channel affine map on ``(N*K, C, *)`` (GroupNorm, InstanceNorm)."""
    n_samples, channels = backprops.shape[0] // K, backprops.shape[1]
    positions = math.prod(backprops.shape[2:])
    out: dict[torch.Tensor, torch.Tensor] = {}
    if wants_grad(weight):
        # A product then one reduction over (copies, positions): an einsum keeping the channel as
        # a batch axis would first copy both operands to move K next to the positions.
        weighted = (backprops * x_hat).reshape(n_samples, K, channels, positions)  # (N, K, C, S)
        out[weight] = weighted.sum((1, 3))  # (N, C)
    if wants_grad(bias):
        out[bias] = backprops.reshape(n_samples, K, channels, positions).sum((1, 3))  # (N, C)
    return out


@register_grad_sampler(nn.LayerNorm, k_aware=True)
def layer_norm_grad_sample(layer: nn.LayerNorm, activations: list[torch.Tensor],
                           backprops: torch.Tensor, K: int) -> dict[torch.Tensor, torch.Tensor]:
    """Per-sample gradients of ``nn.LayerNorm`` (weight and, unless ``bias=False``, bias).

    ``activations[0]`` is ``(N*K, *, *normalized_shape)``; results are ``(N, *normalized_shape)``.

    >>> layer = nn.LayerNorm([2, 3])
    >>> grads = layer_norm_grad_sample(layer, [torch.randn(6, 5, 2, 3)], torch.ones(6, 5, 2, 3), 3)
    >>> grads[layer.weight].shape, grads[layer.bias][0, 0, 0].item()
    (torch.Size([2, 2, 3]), 15.0)
    """
    shape = tuple(layer.normalized_shape)
    x_hat = F.layer_norm(activations[0], shape, eps=layer.eps)  # (N*K, *, *S)
    return _trailing_affine_grads(layer.weight, layer.bias, x_hat, backprops, shape, K)


@register_grad_sampler(nn.RMSNorm, k_aware=True)
def rms_norm_grad_sample(layer: nn.RMSNorm, activations: list[torch.Tensor],
                         backprops: torch.Tensor, K: int) -> dict[torch.Tensor, torch.Tensor]:
    """Per-sample gradient of ``nn.RMSNorm.weight``: ``(N, *normalized_shape)``.

    ``eps=None`` means ``torch.finfo(input.dtype).eps``, as in torch.

    >>> layer = nn.RMSNorm(4, eps=None)
    >>> x = torch.full((2, 4), 3.0)
    >>> layer_grad = rms_norm_grad_sample(layer, [x], torch.ones(2, 4), 1)[layer.weight]
    >>> torch.allclose(layer_grad, torch.ones(2, 4))
    True
    """
    shape = tuple(layer.normalized_shape)
    x_hat = F.rms_norm(activations[0], shape, eps=layer.eps)  # (N*K, *, *S)
    return _trailing_affine_grads(layer.weight, None, x_hat, backprops, shape, K)


@register_grad_sampler(nn.GroupNorm, k_aware=True, batch_first_only=True)
def group_norm_grad_sample(layer: nn.GroupNorm, activations: list[torch.Tensor],
                           backprops: torch.Tensor, K: int) -> dict[torch.Tensor, torch.Tensor]:
    """Per-sample gradients of ``nn.GroupNorm``: weight and bias ``(N, C)``.

    ``activations[0]`` is ``(N*K, C, *)``.

    >>> layer = nn.GroupNorm(2, 4)
    >>> grads = group_norm_grad_sample(layer, [torch.randn(4, 4, 3)], torch.ones(4, 4, 3), 2)
    >>> grads[layer.bias].tolist()
    [[6.0, 6.0, 6.0, 6.0], [6.0, 6.0, 6.0, 6.0]]
    """
    fast = _group_norm_by_kernel(layer, activations[0], backprops, K)
    if fast is not None:
        return fast
    x_hat = F.group_norm(activations[0], layer.num_groups, eps=layer.eps)  # (N*K, C, *)
    return _channel_affine_grads(layer.weight, layer.bias, x_hat, backprops, K)


def _group_norm_by_kernel(layer: nn.GroupNorm, x: torch.Tensor, backprops: torch.Tensor,
                          K: int) -> dict[torch.Tensor, torch.Tensor] | None:
    """GroupNorm's per-sample gradients from torch's own GroupNorm weight-gradient kernel, with no
    ``(N*K, C, *)`` temporary: the rows as one sample of ``N*K*C`` channels in ``N*K*G`` groups
    (each row's groups keep their channels and statistics), whose weight and bias gradients are
    each row's own; their statistics from one reduction. ``x_hat`` and ``g * x_hat`` cost two
    fresh activation-sized buffers per layer (a CIFAR CNN's four GroupNorms: 38 MB a step,
    whose page faults took longer than the arithmetic). None where it does not apply (then
    :func:`_channel_affine_grads` serves): float32/float64 contiguous input and gradient."""
    if x.dtype not in (torch.float32, torch.float64) or backprops.dtype is not x.dtype or x.dim() < 2 \
            or x.shape != backprops.shape or not x.is_contiguous() or not backprops.is_contiguous() \
            or x.numel() == 0:
        return None
    rows, channels, groups = x.shape[0], x.shape[1], layer.num_groups
    positions = x.numel() // (rows * channels)
    with torch.no_grad():
        var, mean = torch.var_mean(x.view(rows * groups, -1), dim=1, unbiased=False)  # (N*K*G,)
        rstd = (var + layer.eps).rsqrt()
        _, weight_grad, bias_grad = torch.ops.aten.native_group_norm_backward(
            backprops.view(1, rows * channels, positions), x.view(1, rows * channels, positions),
            mean.view(1, -1), rstd.view(1, -1), x.new_ones(rows * channels),  # (gamma: read for dx only)
            1, rows * channels, positions, rows * groups, [False, True, True])  # (N*K*C,) each
    n_samples = rows // K
    out: dict[torch.Tensor, torch.Tensor] = {}
    if wants_grad(layer.weight):
        out[layer.weight] = weight_grad.view(n_samples, K, channels).sum(1) if K > 1 else \
            weight_grad.view(n_samples, channels)
    if wants_grad(layer.bias):
        out[layer.bias] = bias_grad.view(n_samples, K, channels).sum(1) if K > 1 else bias_grad.view(n_samples, channels)
    return out


# Inputs InstanceNorm{1,2,3}d accept with a batch dimension; one fewer is an unbatched call.
_INSTANCE_NORM_DIMS: dict[type[nn.Module], int] = {nn.InstanceNorm1d: 3, nn.InstanceNorm2d: 4,
                                                   nn.InstanceNorm3d: 5}


@register_grad_sampler(nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d, k_aware=True,
                       batch_first_only=True)
def instance_norm_grad_sample(layer: nn.InstanceNorm1d | nn.InstanceNorm2d | nn.InstanceNorm3d,
                              activations: list[torch.Tensor], backprops: torch.Tensor,
                              K: int) -> dict[torch.Tensor, torch.Tensor]:
    """Per-sample gradients of ``nn.InstanceNorm{1,2,3}d(affine=True)``: weight and bias ``(N, C)``.

    Normalises with the row's own statistics in training mode or without
    ``track_running_stats``, and with the running statistics otherwise, as torch does.

    >>> layer = nn.InstanceNorm1d(3, affine=True)
    >>> grads = instance_norm_grad_sample(layer, [torch.randn(2, 3, 5)], torch.ones(2, 3, 5), 1)
    >>> grads[layer.weight].abs().max().item() < 1e-5, grads[layer.bias].shape
    (True, torch.Size([2, 3]))
    """
    x = activations[0]  # (N*K, C, *)
    expected = next((d for t, d in _INSTANCE_NORM_DIMS.items() if isinstance(layer, t)), None)
    if expected is not None and x.dim() != expected:
        raise UnsupportedModuleError(
            f"instance_norm_grad_sample: {type(layer).__name__} got a {x.dim()}-D input; per-sample "
            f"gradients need the batched {expected}-D form (N*K, C, ...)")
    if layer.training or not layer.track_running_stats:
        # Running statistics (if tracked) were already updated by the forward pass.
        x_hat = F.instance_norm(x, eps=layer.eps)  # (N*K, C, *)
    else:
        x_hat = F.instance_norm(x, layer.running_mean, layer.running_var, use_input_stats=False,
                                eps=layer.eps)  # (N*K, C, *)
    return _channel_affine_grads(layer.weight, layer.bias, x_hat, backprops, K)


@register_grad_sampler(nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, k_aware=True, batch_first_only=True)
def batch_norm_grad_sample(layer: nn.BatchNorm1d | nn.BatchNorm2d | nn.BatchNorm3d, activations: list[torch.Tensor],
                           backprops: torch.Tensor, K: int) -> dict[torch.Tensor, torch.Tensor]:
    """Per-sample gradients of a BatchNorm in eval mode: weight and bias ``(N, C)``.

    With its running statistics the layer is a per-channel affine map of each row (a pretrained
    network fine-tuned with its statistics frozen); in training mode, or without running
    statistics, it normalises with the whole batch's and is refused (psg_core.fix_model swaps it
    for GroupNorm).

    >>> layer = nn.BatchNorm1d(3).eval()
    >>> grads = batch_norm_grad_sample(layer, [torch.randn(4, 3)], torch.ones(4, 3), 2)
    >>> grads[layer.bias].tolist()
    [[2.0, 2.0, 2.0], [2.0, 2.0, 2.0]]
    """
    if layer.training or layer.running_mean is None or layer.running_var is None:
        raise UnsupportedModuleError(
            f"batch_norm_grad_sample: {type(layer).__name__} normalises with the batch's statistics (training "
            "mode, or no running statistics), which mixes samples; call .eval() on it with running statistics, "
            "or replace it with GroupNorm (psg_core.fix_model does)")
    x_hat = F.batch_norm(activations[0], layer.running_mean, layer.running_var, training=False,
                         eps=layer.eps)  # (N*K, C, *)
    return _channel_affine_grads(layer.weight, layer.bias, x_hat, backprops, K)
