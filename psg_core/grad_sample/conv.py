"""Per-sample gradients of the convolution family: ``nn.Conv1d/2d/3d`` and ``nn.ConvTranspose1d/2d/3d``.

A convolution is a matrix product over unfolded patches (im2col). For one input row the weight
gradient of a convolution is ``sum_l g[:, l] u[:, l]^T``, where ``u[:, l]`` is the patch of the
(padded) input that produced output position ``l`` and ``g[:, l]`` is the output gradient there;
with groups, each group is its own product. A transposed convolution is the adjoint of a
convolution that maps its *output* space to its *input* space, so the same identity holds with the
roles swapped: the patches come from the output gradient and the per-position factor is the
input.

Both cases are expressed as a pair of factors (see :func:`conv_weight_factors`)::

    patches:      (rows, G, I, L)    I = channels per group of the unfolded tensor * prod(kernel)
    output_grads: (rows, G, O, L)    O = channels per group of the other tensor

and the per-sample gradient of a transposed convolution is one contraction over the K copies and
the L positions (the copies are folded next to the positions while the patches are copied out, so
the contraction is a single batched matmul). The ghost norm of the family (registered below)
reuses the same factors to get per-sample norms from Gram matrices over L, one pair per group.

A weight gradient also needs no unfolded patches: stacking the samples along channels turns the
per-sample gradients into the weight gradient of one grouped convolution (``groups = N * G``)
whose batch is the K copies, which torch's convolution backward computes directly, with the sum
over copies built in and without im2col's ``prod(kernel_size)``-fold copy of the input (for a
transposed convolution, of its adjoint convolution). A depthwise convolution has a third way:
each row's input correlated with its own output gradient, all rows as one forward convolution
whose weights are the output gradients (``correlate``). Which way is fastest depends on the
shape, dtype and device: :mod:`psg_core.grad_sample.conv_strategy` chooses, by a rule or by
measuring once per shape, and so it does for the ghost norm (Gram pair or materialised gradient).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from opt_einsum import contract
from torch import nn

from psg_core.errors import BatchLayoutError, ConfigError
from psg_core.grad_sample._utils import wants_grad
from psg_core.grad_sample.conv_strategy import (PER_SAMPLE_STRATEGIES, ConvStrategy, admissible, choose_measured,
                                                current_conv_strategy, rule_per_sample, seed_cache)
from psg_core.grad_sample.ghost_norm import GhostFactors, WeightLayout, register_ghost_norm
from psg_core.grad_sample.registry import register_grad_sampler
from psg_core.layout import fold_rows

__all__ = ["ConvFactors", "conv_unfold", "conv_weight_factors", "conv_weight_per_sample", "conv_weight_sum",
           "conv_grad_sample", "conv_transpose_grad_sample", "conv_ghost_factors", "conv_per_sample_strategy"]

_ConvLayer = nn.Conv1d | nn.Conv2d | nn.Conv3d
_ConvTransposeLayer = nn.ConvTranspose1d | nn.ConvTranspose2d | nn.ConvTranspose3d
_CONV_TYPES = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_CONV_TRANSPOSE_TYPES = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


class ConvFactors(NamedTuple):
    """The two factors whose product over positions is a convolution's per-row weight gradient.

    ``grad_weight[r] = einsum("rgil,rgol->rgoi", patches, output_grads)``, reshaped to
    ``(G * O, *weight.shape[1:])``, which is ``weight.shape``.
    """

    #: ``(rows, G, I, L)``: unfolded patches (I = per-group channels * prod(kernel)).
    patches: torch.Tensor
    #: ``(rows, G, O, L)``: the factor each patch is multiplied with (O = weight.shape[0] / G).
    output_grads: torch.Tensor


def _spatial_dims(layer: nn.modules.conv._ConvNd) -> int:
    return len(layer.kernel_size)


def _check_batched(where: str, layer: nn.Module, tensor: torch.Tensor, dims: int,
                   what: str) -> None:
    if tensor.dim() != dims + 2:
        raise BatchLayoutError(
            f"{where}: {type(layer).__name__} needs a batched {what} of {dims + 2} dims "
            f"(rows, channels, *spatial), got shape {tuple(tensor.shape)}; unbatched inputs "
            "cannot be attributed to samples")


def _padding_pairs(layer: _ConvLayer) -> list[tuple[int, int]]:
    """``(before, after)`` padding per spatial dim, as the layer's forward applies it.

    ``padding="same"`` puts the odd unit of an uneven total on the trailing side, as torch does.
    """
    dims = _spatial_dims(layer)
    if layer.padding == "valid":
        return [(0, 0)] * dims
    if layer.padding == "same":
        pairs = []
        for kernel, dilation in zip(layer.kernel_size, layer.dilation):
            total = dilation * (kernel - 1)
            pairs.append((total // 2, total - total // 2))
        return pairs
    return [(int(p), int(p)) for p in layer.padding]  # type: ignore[union-attr]


def _pad(x: torch.Tensor, pairs: list[tuple[int, int]], padding_mode: str) -> torch.Tensor:
    """Pads the trailing spatial dims of ``x`` with ``pairs`` in the conv's padding mode."""
    if not any(before or after for before, after in pairs):
        return x
    flat = [amount for pair in reversed(pairs) for amount in pair]  # F.pad: last dim first
    mode = "constant" if padding_mode == "zeros" else padding_mode
    return F.pad(x, flat, mode=mode)


def _windows(padded: torch.Tensor, *, kernel_size: tuple[int, ...], stride: tuple[int, ...],
             dilation: tuple[int, ...], out_spatial: tuple[int, ...], where: str) -> torch.Tensor:
    """``(B, C, *P)`` already padded -> ``(B, C, *kernel, *out_spatial)``: every patch, as a view.

    Works for any number of spatial dims. ``out_spatial`` may be smaller than the number of
    positions that fit (a transposed conv with ``output_padding`` only needs the first ones),
    never larger.
    """
    rows, channels, *padded_spatial = padded.shape
    for axis, (size, k, s, d, out) in enumerate(zip(padded_spatial, kernel_size, stride, dilation,
                                                    out_spatial)):
        needed = (out - 1) * s + d * (k - 1) + 1
        if out < 1 or needed > size:
            raise BatchLayoutError(
                f"{where}: spatial axis {axis} of size {size} (after padding) cannot hold {out} "
                f"positions of a kernel {k} with stride {s} and dilation {d}")
    padded = padded.contiguous()
    row_stride, channel_stride, *spatial_strides = padded.stride()
    sizes = (rows, channels, *kernel_size, *out_spatial)
    strides = (row_stride, channel_stride,
               *(st * d for st, d in zip(spatial_strides, dilation)),
               *(st * s for st, s in zip(spatial_strides, stride)))
    return padded.as_strided(sizes, strides)  # (B, C, *kernel, *out_spatial)


def _fold_windows(windows: torch.Tensor, *, groups: int, K: int) -> torch.Tensor:
    """``(N*K, C, *kernel, *L)`` view -> ``(N, G, C/G * prod(kernel), K * prod(L))``, one copy.

    The K copies of a sample land next to its positions, so that the per-sample contraction over
    copies and positions is a single matrix product with no further copy.
    """
    rows, channels = windows.shape[:2]
    spatial = (windows.dim() - 2) // 2
    kernel, positions = windows.shape[2:2 + spatial], windows.shape[2 + spatial:]
    split = windows.reshape(rows // K, K, groups, channels // groups, *kernel, *positions)  # view
    # (N, K, G, C/G, *kernel, *L) -> (N, G, C/G, *kernel, K, *L)
    order = (0, 2, 3, *range(4, 4 + spatial), 1, *range(4 + spatial, 4 + 2 * spatial))
    return split.permute(order).reshape(rows // K, groups, channels // groups * math.prod(kernel),
                                        K * math.prod(positions))  # (N, G, I, K*L)


def _fold_other(other: torch.Tensor, *, groups: int, K: int) -> torch.Tensor:
    """``(N*K, C, *L)`` -> ``(N, G, C/G, K * prod(L))`` (a view when K = 1)."""
    rows, channels = other.shape[:2]
    split = other.reshape(rows // K, K, groups, channels // groups, -1)  # (N, K, G, C/G, L)
    return split.permute(0, 2, 3, 1, 4).reshape(rows // K, groups, channels // groups, -1)  # (N, G, O, K*L)


def _im2col(padded: torch.Tensor, *, kernel_size: tuple[int, ...], stride: tuple[int, ...],
            dilation: tuple[int, ...], groups: int, out_spatial: tuple[int, ...],
            where: str) -> torch.Tensor:
    """``(B, C, *P)`` already padded -> ``(B, G, C/G * prod(kernel), prod(out_spatial))``."""
    windows = _windows(padded, kernel_size=kernel_size, stride=stride, dilation=dilation,
                       out_spatial=out_spatial, where=where)  # (B, C, *kernel, *out_spatial), a view
    rows, channels = windows.shape[:2]
    return windows.reshape(rows, groups, channels // groups * math.prod(kernel_size),
                           math.prod(out_spatial))  # (B, G, C/G*prod(k), L)


def _conv_out_spatial(layer: _ConvLayer, padded_spatial: list[int]) -> tuple[int, ...]:
    return tuple((size - d * (k - 1) - 1) // s + 1 for size, k, s, d in
                 zip(padded_spatial, layer.kernel_size, layer.stride, layer.dilation))


def conv_unfold(layer: _ConvLayer, x: torch.Tensor) -> torch.Tensor:
    """The im2col matrix of a convolution's input: every patch its weight is applied to.

    Applies the layer's own padding first (integer, tuple, ``"same"``, ``"valid"``, and every
    ``padding_mode``), so ``x`` is the tensor the layer was called with.

    Args:
        layer: an ``nn.Conv1d``, ``nn.Conv2d`` or ``nn.Conv3d``.
        x: ``(rows, C_in, *spatial)`` the layer's input.

    Returns:
        ``(rows, G, C_in/G * prod(kernel_size), L)`` with ``G = layer.groups`` and ``L`` the
        number of output positions; the patch axis is ordered like ``weight[o].flatten()``, so
        ``weight.view(G, C_out/G, -1) @ conv_unfold(layer, x)`` is the output without bias.

    >>> conv = nn.Conv2d(4, 6, 3, padding=1, groups=2)
    >>> conv_unfold(conv, torch.randn(5, 4, 8, 8)).shape
    torch.Size([5, 2, 18, 64])
    """
    if not isinstance(layer, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        raise ConfigError(
            f"conv_unfold: expected nn.Conv1d/2d/3d, got {type(layer).__qualname__}; use "
            "conv_weight_factors for transposed convolutions")
    _check_batched("conv_unfold", layer, x, _spatial_dims(layer), "input")
    padded = _pad(x, _padding_pairs(layer), layer.padding_mode)  # (B, C_in, *P)
    out_spatial = _conv_out_spatial(layer, list(padded.shape[2:]))
    return _im2col(padded, kernel_size=layer.kernel_size, stride=layer.stride,
                   dilation=layer.dilation, groups=layer.groups, out_spatial=out_spatial,
                   where="conv_unfold")


def conv_weight_factors(layer: _ConvLayer | _ConvTransposeLayer, activation: torch.Tensor,
                        backprop: torch.Tensor, augmentation_multiplicity: int = 1) -> ConvFactors:
    """Factors ``(patches, output_grads)`` of a (transposed) convolution's per-row weight gradient.

    For ``nn.ConvNd`` the patches are :func:`conv_unfold` of the input and the other factor is the
    output gradient. For ``nn.ConvTransposeNd`` (the adjoint of a convolution from its output
    space to its input space) the patches are the unfolded output gradient, padded by
    ``layer.padding``, and the other factor is the input; ``output_padding`` and an explicit
    ``output_size`` need no special case because only the positions that meet an input are used.

    Args:
        layer: the convolution.
        activation: ``(rows, C_in, *in_spatial)`` its input.
        backprop: ``(rows, C_out, *out_spatial)`` the gradient of the loss w.r.t. its output.
        augmentation_multiplicity: K. With K > 1 the factors are per *sample*: rows ``n*K ..
        n*K+K-1`` are folded into the position axis, ``(N, G, I, K*L)`` and ``(N, G, O, K*L)``,
        in the single copy that takes the patches out of their strided view (folding
        ``(rows, G, I, L)`` factors afterwards would copy them again).

    Returns:
        :class:`ConvFactors`; ``contract("rgil,rgol->rgoi", *factors)`` reshaped to
        ``(rows, *weight.shape)`` is each row's weight gradient (each sample's, summed over its
        K rows, when K > 1).

    >>> deconv = nn.ConvTranspose1d(4, 6, 3, stride=2, groups=2)
    >>> x = torch.randn(4, 4, 5)
    >>> factors = conv_weight_factors(deconv, x, torch.randn_like(deconv(x)))
    >>> factors.patches.shape, factors.output_grads.shape
    (torch.Size([4, 2, 9, 5]), torch.Size([4, 2, 2, 5]))
    >>> folded = conv_weight_factors(deconv, x, torch.randn_like(deconv(x)), augmentation_multiplicity=2)
    >>> folded.patches.shape, folded.output_grads.shape
    (torch.Size([2, 2, 9, 10]), torch.Size([2, 2, 2, 10]))
    """
    K = augmentation_multiplicity
    _check_multiplicity("conv_weight_factors", activation, K)
    windows, other = _factor_views(layer, activation, backprop)  # (B, C_w, *k, *L), (B, C_o, *L)
    return ConvFactors(_fold_windows(windows, groups=layer.groups, K=K),  # (N, G, I, K*L)
                       _fold_other(other, groups=layer.groups, K=K))  # (N, G, O, K*L)


def _check_multiplicity(where: str, activation: torch.Tensor, K: int) -> None:
    if isinstance(K, bool) or not isinstance(K, int) or K < 1 or activation.shape[0] % K:
        raise BatchLayoutError(f"{where}: augmentation_multiplicity must be an int >= 1 that divides the "
                               f"{activation.shape[0]} rows, got {K!r}")


def conv_weight_per_sample(layer: _ConvLayer | _ConvTransposeLayer, activation: torch.Tensor,
                           backprop: torch.Tensor, augmentation_multiplicity: int = 1,
                           strategy: ConvStrategy | str | None = None) -> torch.Tensor:
    """``(N, *weight.shape)``: each sample's weight gradient, summed over its K rows.

    Either the weight gradient of one grouped convolution over the samples (``grouped_conv``,
    no unfolded patches), the unfolded patches contracted with the output gradients in one
    batched matmul (``unfold``) or, for a depthwise convolution, the inputs correlated with their
    output gradients by one forward convolution (``correlate``); ``strategy=None`` takes the one
    :func:`conv_per_sample_strategy` chooses (see :mod:`psg_core.grad_sample.conv_strategy`).
    What the conv grad samplers use, and what ghost clipping calls when it materialises a conv
    layer's per-sample gradients.

    >>> conv = nn.Conv2d(2, 4, 3, padding=1)
    >>> x, g = torch.randn(6, 2, 5, 5), torch.randn(6, 4, 5, 5)
    >>> conv_weight_per_sample(conv, x, g, 3).shape
    torch.Size([2, 4, 2, 3, 3])
    >>> torch.allclose(conv_weight_per_sample(conv, x, g, 3, strategy="unfold"),
    ...                conv_weight_per_sample(conv, x, g, 3, strategy="grouped_conv"), atol=1e-5)
    True
    """
    K = augmentation_multiplicity
    where = "conv_weight_per_sample"
    _check_multiplicity(where, activation, K)
    if not isinstance(layer, (*_CONV_TYPES, *_CONV_TRANSPOSE_TYPES)):
        raise ConfigError(f"{where}: expected a convolution layer, got {type(layer).__qualname__}")
    _check_batched(where, layer, activation, _spatial_dims(layer), "input")
    _check_batched(where, layer, backprop, _spatial_dims(layer), "output gradient")
    if strategy is None:
        chosen = conv_per_sample_strategy(layer, activation, backprop, K)
    else:
        chosen = ConvStrategy(strategy)
        if chosen not in PER_SAMPLE_STRATEGIES:
            raise ConfigError(f"{where}: strategy must be one of {[s.value for s in PER_SAMPLE_STRATEGIES]} "
                              f"(or None), got {strategy!r}")
        if chosen not in _applicable(layer):
            raise ConfigError(f"{where}: strategy {chosen.value!r} applies to depthwise convolutions only "
                              f"(groups == in_channels), not {type(layer).__name__}(groups={layer.groups}, "
                              f"in_channels={layer.in_channels})")
    return _PER_SAMPLE[chosen](layer, activation, backprop, K)  # (N, *weight)


def _per_sample_by_unfold(layer: _ConvLayer | _ConvTransposeLayer, activation: torch.Tensor,
                          backprop: torch.Tensor, K: int) -> torch.Tensor:
    """``(N, *weight)`` from the folded factors: one batched matmul over copies and positions."""
    patches, other = conv_weight_factors(layer, activation, backprop, K)  # (N, G, I, K*L), (N, G, O, K*L)
    grad = torch.matmul(other, patches.transpose(-1, -2))  # (N, G, O, I): one batched product
    return grad.reshape(grad.shape[0], *layer.weight.shape)  # (N, *weight)


def _per_sample_by_grouped_conv(layer: _ConvLayer | _ConvTransposeLayer, activation: torch.Tensor,
                                backprop: torch.Tensor, K: int) -> torch.Tensor:
    if isinstance(layer, _CONV_TYPES):
        return _conv_weight_by_grouped_conv(layer, activation, backprop, K)
    return _conv_transpose_weight_by_grouped_conv(layer, activation, backprop, K)


def is_depthwise(layer: nn.Module) -> bool:
    """A (non-transposed) convolution whose every input channel is its own group (``groups ==
    in_channels``, any number of output channels per group): the layers ``correlate`` applies to.

    >>> is_depthwise(nn.Conv2d(8, 16, 7, groups=8)), is_depthwise(nn.Conv2d(8, 16, 3, groups=4))
    (True, False)
    """
    return isinstance(layer, _CONV_TYPES) and layer.groups == layer.in_channels


_CONV_FORWARD = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def _per_sample_by_correlation(layer: _ConvLayer, activation: torch.Tensor, backprop: torch.Tensor,
                               K: int) -> torch.Tensor:
    """``(N, *weight)`` of a depthwise convolution: each row's input correlated with its own output
    gradient, all rows at once as one *forward* convolution, then each sample's K rows summed.

    Output channel o of a depthwise layer reads input channel ``c = o // m`` alone (m output
    channels per input channel), so row r's gradient at kernel offset p is
    ``sum_l g[r, o, l] x_pad[r, c, s l + d p]`` (s the stride, d the dilation, l the output
    position): a convolution of the padded input (channels ``(r, c)``, ``groups = rows * C``, one
    input channel each) with the output gradients as its weights (``(rows * C * m, 1, *L)``),
    stride d and dilation s, its first ``kernel_size`` positions. A weight-gradient kernel over
    ``N * C`` one-channel groups (``grouped_conv``) spends most of its time on per-group overhead at
    these shapes (ConvNeXt's 7x7 depthwise layers, one thread on the 2-core AMD EPYC: 0.2 against
    1.1-1.7 ms at 2x2 to 8x8, 13 against 165 ms at 56x56). The K copies are summed after the
    product (K input channels per group would take oneDNN off its depthwise kernel: 7x slower).
    """
    rows, channels = activation.shape[0], layer.in_channels
    source, padding = _kernel_input(layer, activation)  # (rows, C, *P), the kernel's own padding
    x = source.reshape(1, rows * channels, *source.shape[2:])  # a view
    g = backprop.reshape(rows * layer.out_channels, 1, *backprop.shape[2:]).to(x.dtype)  # a view
    if x.dim() == 4 and all(size < k for size, k in zip(backprop.shape[2:], layer.kernel_size)):
        # Output gradients smaller than the kernel (a 7x7 layer on 2x2 to 4x4 maps): oneDNN's
        # channels-last depthwise kernel is 2-10x faster there than its channels-first one.
        x, g = x.contiguous(memory_format=torch.channels_last), g.contiguous(memory_format=torch.channels_last)
    out = _CONV_FORWARD[source.dim() - 2](x, g, None, list(layer.dilation), padding, list(layer.stride),
                                         rows * channels)  # (1, rows*C_out, >= *kernel)
    for axis, size in enumerate(layer.kernel_size):
        out = out.narrow(2 + axis, 0, size)
    grads = out.reshape(rows // K, K, *layer.weight.shape)  # (N, K, C_out, 1, *kernel)
    return grads.squeeze(1) if K == 1 else grads.sum(1)  # (N, *weight)


_PerSampleFn = Callable[[Any, torch.Tensor, torch.Tensor, int], torch.Tensor]
_PER_SAMPLE: dict[ConvStrategy, _PerSampleFn] = {ConvStrategy.GROUPED_CONV: _per_sample_by_grouped_conv,
                                                 ConvStrategy.UNFOLD: _per_sample_by_unfold,
                                                 ConvStrategy.CORRELATE: _per_sample_by_correlation}


def _applicable(layer: nn.Module) -> tuple[ConvStrategy, ...]:
    """The per-sample strategies that apply to ``layer``."""
    return PER_SAMPLE_STRATEGIES if is_depthwise(layer) else (ConvStrategy.GROUPED_CONV, ConvStrategy.UNFOLD)


def _measurable(strategies: list[ConvStrategy], device: torch.device) -> list[ConvStrategy]:
    """The strategies ``auto`` times on ``device``: ``correlate`` only off CUDA, where it was
    measured (cuDNN's forward kernel with output gradients as ``(L, L)`` weights and ``rows * C``
    groups is untimed; forcing ``correlate`` runs it there)."""
    return [s for s in strategies if s is not ConvStrategy.CORRELATE or device.type != "cuda"]


def conv_weight_sum(layer: _ConvLayer | _ConvTransposeLayer, activation: torch.Tensor,
                    backprop: torch.Tensor) -> torch.Tensor:
    """``weight.shape``: the weight gradient summed over every row (what autograd would give).

    With ``backprop`` scaled row by row this is a weighted sum of per-row gradients, which is how
    ghost clipping gets its clipped sum from the activations and output gradients it kept: one
    convolution weight-gradient kernel, no per-sample tensor and no second backward.

    >>> conv = nn.Conv2d(2, 4, 3, padding=1, padding_mode="reflect")
    >>> x = torch.randn(6, 2, 5, 5)
    >>> g = torch.randn(6, 4, 5, 5)
    >>> torch.allclose(conv_weight_sum(conv, x, g), conv_weight_per_sample(conv, x, g).sum(0), atol=1e-5)
    True
    """
    if isinstance(layer, _CONV_TYPES):
        dims = _spatial_dims(layer)
        _check_batched("conv_weight_sum", layer, activation, dims, "input")
        _check_batched("conv_weight_sum", layer, backprop, dims, "output gradient")
        source, padding = _kernel_input(layer, activation)  # (B, C_in, *S), kernel's own padding
        return _conv_weight_grad(layer, source, backprop, tuple(layer.weight.shape), layer.groups,
                                 padding=padding)
    patches, other = conv_weight_factors(layer, activation, backprop)  # (B, G, I, L), (B, G, O, L)
    grad = contract("bgol,bgil->goi", other, patches)  # (G, O, I)
    return grad.reshape(layer.weight.shape)


def _factor_views(layer: _ConvLayer | _ConvTransposeLayer, activation: torch.Tensor,
                  backprop: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfolded factor as a strided view ``(B, C_w, *kernel, *L)`` and the other factor
    ``(B, C_o, *L)`` (see :func:`conv_weight_factors`); no copy of the patches yet."""
    dims = _spatial_dims(layer)
    _check_batched("conv_weight_factors", layer, activation, dims, "input")
    _check_batched("conv_weight_factors", layer, backprop, dims, "output gradient")
    if isinstance(layer, _CONV_TYPES):
        padded = _pad(activation, _padding_pairs(layer), layer.padding_mode)  # (B, C_in, *P)
        out_spatial = _conv_out_spatial(layer, list(padded.shape[2:]))
        if math.prod(out_spatial) != math.prod(backprop.shape[2:]):
            raise BatchLayoutError(
                f"conv_weight_factors: {type(layer).__name__} unfolds to {math.prod(out_spatial)} "
                f"positions but its output gradient has spatial shape {tuple(backprop.shape[2:])}")
        windows = _windows(padded, kernel_size=layer.kernel_size, stride=layer.stride,
                           dilation=layer.dilation, out_spatial=out_spatial,
                           where="conv_weight_factors")  # (B, C_in, *k, *L_out)
        return windows, backprop
    if isinstance(layer, _CONV_TRANSPOSE_TYPES):
        padded = _transpose_padded_backprop(layer, backprop, "conv_weight_factors")  # (B, C_out, *P)
        windows = _windows(padded, kernel_size=layer.kernel_size, stride=layer.stride,
                           dilation=layer.dilation, out_spatial=tuple(activation.shape[2:]),
                           where="conv_weight_factors")  # (B, C_out, *k, *L_in)
        return windows, activation
    raise ConfigError(f"conv_weight_factors: expected a convolution layer, got "
                      f"{type(layer).__qualname__}")


def _transpose_padded_backprop(layer: _ConvTransposeLayer, backprop: torch.Tensor, where: str) -> torch.Tensor:
    """A transposed convolution's output gradient padded by ``layer.padding``: the input of its
    adjoint convolution (output space -> input space)."""
    if layer.padding_mode != "zeros":
        raise ConfigError(f"{where}: {type(layer).__name__} only supports padding_mode='zeros', got "
                          f"{layer.padding_mode!r}")
    pairs = [(int(p), int(p)) for p in layer.padding]  # type: ignore[union-attr]
    return _pad(backprop, pairs, "zeros")  # (B, C_out, *P)


def _kernel_input(layer: _ConvLayer, activation: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """The input to hand torch's weight-gradient kernel and the padding it should apply itself.

    Symmetric zero padding is the kernel's own job (no padded copy of the input); any other
    padding (reflect, replicate, circular, an uneven ``"same"``) is applied here first.
    """
    pairs = _padding_pairs(layer)
    if layer.padding_mode == "zeros" and all(before == after for before, after in pairs):
        return activation, [before for before, _ in pairs]
    return _pad(activation, pairs, layer.padding_mode), [0] * len(pairs)  # (B, C_in, *P)


def _stack_samples(rows: torch.Tensor, K: int) -> torch.Tensor:
    """``(N*K, C, *S)`` -> ``(K, N*C, *S)``: copies become the batch, samples channel groups."""
    n_samples, channels = rows.shape[0] // K, rows.shape[1]
    return rows.reshape(n_samples, K, channels, *rows.shape[2:]).transpose(0, 1).reshape(
        K, n_samples * channels, *rows.shape[2:])


def _conv_weight_by_grouped_conv(layer: _ConvLayer, activation: torch.Tensor, backprop: torch.Tensor,
                                 K: int) -> torch.Tensor:
    """``(N, *weight.shape)``: per-sample weight gradients of a convolution as one weight gradient
    of a grouped convolution, summed over the K copies.

    Sample n's gradient is the weight gradient of the same convolution applied to its K rows
    alone. Stacking the N samples along channels (``groups = N * G``) and taking the K copies as
    that convolution's batch, the weight gradient of the grouped convolution *is* the stack of
    per-sample gradients, each already summed over its copies; torch's own convolution backward
    computes it, without unfolding patches (im2col would hold ``prod(kernel_size)`` copies of the
    input).
    """
    n_samples = activation.shape[0] // K
    source, padding = _kernel_input(layer, activation)  # (N*K, C_in, *S)
    weight_shape = (n_samples * layer.weight.shape[0], *layer.weight.shape[1:])
    grad = _conv_weight_grad(layer, _stack_samples(source, K), _stack_samples(backprop, K), weight_shape,
                             n_samples * layer.groups, padding=padding)  # (N*C_out, C_in/G, *k)
    return grad.view(n_samples, *layer.weight.shape)  # (N, *weight)


def _conv_transpose_weight_by_grouped_conv(layer: _ConvTransposeLayer, activation: torch.Tensor,
                                           backprop: torch.Tensor, K: int) -> torch.Tensor:
    """``(N, *weight.shape)`` for a transposed convolution, by the same grouped-convolution trick.

    The weight ``(C_in, C_out/G, *k)`` of a transposed convolution is the weight of its adjoint
    convolution, which maps the (padded) output space to the input space: its input is the
    output gradient and its output gradient is the layer's input. Output positions that meet no
    input (``output_padding``) are cut off so that the adjoint's output has the input's size.
    """
    n_samples = activation.shape[0] // K
    where = "conv_weight_per_sample"
    padded = _transpose_padded_backprop(layer, backprop, where)  # (N*K, C_out, *P)
    needed = [(size - 1) * s + d * (k - 1) + 1 for size, k, s, d in
              zip(activation.shape[2:], layer.kernel_size, layer.stride, layer.dilation)]
    for axis, (have, need) in enumerate(zip(padded.shape[2:], needed)):
        if need > have:
            raise BatchLayoutError(
                f"{where}: {type(layer).__name__}'s padded output gradient has {have} positions on spatial "
                f"axis {axis}, fewer than the {need} its input of shape {tuple(activation.shape[2:])} needs")
    cropped = padded
    for axis, need in enumerate(needed):
        cropped = cropped.narrow(2 + axis, 0, need)  # (N*K, C_out, *needed) in the end, a view
    weight_shape = (n_samples * layer.weight.shape[0], *layer.weight.shape[1:])
    grad = _conv_weight_grad(layer, _stack_samples(cropped, K), _stack_samples(activation, K), weight_shape,
                             n_samples * layer.groups, padding=[0] * len(needed))  # (N*C_in, C_out/G, *k)
    return grad.view(n_samples, *layer.weight.shape)  # (N, *weight)


def _conv_weight_grad(layer: _ConvLayer | _ConvTransposeLayer, source: torch.Tensor, backprop: torch.Tensor,
                      weight_shape: tuple[int, ...], groups: int, *, padding: list[int]) -> torch.Tensor:
    """torch's convolution weight-gradient kernel alone: the gradient of a (non-transposed)
    convolution of ``source`` with ``padding`` whose output gradient is ``backprop``."""
    dims = _spatial_dims(layer)
    # Only the weight's shape is read (no input gradient is asked for): a broadcast scalar will do.
    weight = source.new_empty(()).expand(weight_shape)
    _, grad, _ = torch.ops.aten.convolution_backward(
        backprop, source, weight, None, list(layer.stride), padding, list(layer.dilation),
        False, [0] * dims, groups, [False, True, False])  # weight_shape
    return grad


# ------------------------------------------------------------------------------ strategy choice
class _Sizes(NamedTuple):
    """The sizes the strategies' costs depend on (elements, per call)."""

    samples: int  # N
    groups: int  # G
    out_per_group: int  # O: weight rows per group
    patch: int  # I: unfolded patch length per group
    positions: int  # T = K * L: positions each sample sums over
    weight: int  # weight.numel()
    activations: int  # elements of the input and the output gradient: alive anyway
    copies: int  # K

    @classmethod
    def of(cls, layer: _ConvLayer | _ConvTransposeLayer, activation: torch.Tensor, backprop: torch.Tensor,
           K: int) -> _Sizes:
        groups = layer.groups
        kernel = math.prod(layer.kernel_size)
        if isinstance(layer, _CONV_TYPES):
            out_per_group, patch = layer.out_channels // groups, layer.in_channels // groups * kernel
            positions = K * math.prod(backprop.shape[2:])
        else:
            out_per_group, patch = layer.in_channels // groups, layer.out_channels // groups * kernel
            positions = K * math.prod(activation.shape[2:])
        return cls(activation.shape[0] // K, groups, out_per_group, patch, positions, layer.weight.numel(),
                   activation.numel() + backprop.numel(), K)

    def factors(self) -> int:
        """Elements of the unfolded patches (the other factor is copied only when K > 1, and
        then it is at most the output gradient's size)."""
        return self.samples * self.groups * self.patch * self.positions

    def per_sample_footprints(self, strategies: tuple[ConvStrategy, ...]) -> dict[ConvStrategy, int]:
        """Extra elements each of ``strategies`` holds: the gradients, plus unfold's patches, plus
        correlate's per-row gradients (K per sample, summed after) and channels-last copies."""
        materialised = self.samples * self.weight
        sizes = {ConvStrategy.GROUPED_CONV: materialised, ConvStrategy.UNFOLD: materialised + self.factors(),
                 ConvStrategy.CORRELATE: materialised * (1 + self.copies) + self.activations}
        return {s: sizes[s] for s in strategies}

    def ghost_footprints(self, strategies: tuple[ConvStrategy, ...]) -> dict[ConvStrategy, int]:
        """As :meth:`per_sample_footprints`, and the Gram pair: the patches, two ``(T, T)`` Grams
        per sample and group, and the activations kept for the clipped sum."""
        grams = 2 * self.samples * self.groups * self.positions * self.positions
        return {**self.per_sample_footprints(strategies),
                ConvStrategy.GRAM: self.factors() + grams + self.activations}


def _signature(purpose: str, layer: _ConvLayer | _ConvTransposeLayer, activation: torch.Tensor,
               backprop: torch.Tensor, K: int) -> tuple[Any, ...]:
    """What a measured choice is cached under: the layer's hyper-parameters, per-row shapes, N
    rounded up to a power of two (Poisson-sampled batches vary in size every step), K, dtypes and
    device."""
    n_samples = activation.shape[0] // K
    bucket = 1 << max(0, n_samples - 1).bit_length()
    hyper = (type(layer).__qualname__, layer.in_channels, layer.out_channels, tuple(layer.kernel_size),
             tuple(layer.stride), layer.padding, tuple(layer.dilation), layer.groups, layer.padding_mode,
             tuple(layer.output_padding))
    return (purpose, hyper, tuple(activation.shape[1:]), tuple(backprop.shape[1:]), bucket, K,
            activation.dtype, backprop.dtype, backprop.device)


def conv_per_sample_strategy(layer: _ConvLayer | _ConvTransposeLayer, activation: torch.Tensor,
                             backprop: torch.Tensor, K: int) -> ConvStrategy:
    """``grouped_conv`` or ``unfold`` for this call: forced, by rule, or measured once per
    signature (see :mod:`psg_core.grad_sample.conv_strategy`).

    >>> conv = nn.Conv2d(64, 64, 3)  # wide, with few positions
    >>> conv_per_sample_strategy(conv, torch.randn(4, 64, 4, 4), torch.randn(4, 64, 2, 2), 1)  # CPU rule
    <ConvStrategy.UNFOLD: 'unfold'>
    """
    device = backprop.device
    mode = current_conv_strategy(device)
    applicable = _applicable(layer)
    if mode in applicable:
        return mode
    sizes = _Sizes.of(layer, activation, backprop, K)
    allowed = admissible(sizes.per_sample_footprints(applicable), sizes.activations)
    if mode is ConvStrategy.AUTO:
        candidates = {s: functools.partial(_PER_SAMPLE[s], layer, activation, backprop, K)
                      for s in _measurable(allowed, device)}
        return choose_measured(_signature("per_sample", layer, activation, backprop, K), candidates, device)
    return rule_per_sample(device=device, groups=sizes.groups, out_per_group=sizes.out_per_group,
                           patch=sizes.patch, positions=sizes.positions, fits=ConvStrategy.UNFOLD in allowed,
                           depthwise=ConvStrategy.CORRELATE in applicable and all(s == 1 for s in layer.stride),
                           row_positions=sizes.positions // sizes.copies)


def _weight_and_bias(layer: _ConvLayer | _ConvTransposeLayer, activation: torch.Tensor,
                     backprops: torch.Tensor, K: int) -> dict[torch.Tensor, torch.Tensor]:
    out: dict[torch.Tensor, torch.Tensor] = {}
    if wants_grad(layer.weight):
        out[layer.weight] = conv_weight_per_sample(layer, activation, backprops, K)  # (N, *weight)
    if wants_grad(layer.bias):
        out[layer.bias] = fold_rows(backprops.flatten(2), K).sum((1, 3))  # (N, C_out)
    return out


# torch fixes a convolution's batch at dim 0 whatever the model's layout.
@register_grad_sampler(nn.Conv1d, nn.Conv2d, nn.Conv3d, k_aware=True, batch_first_only=True)
def conv_grad_sample(layer: _ConvLayer, activations: list[torch.Tensor], backprops: torch.Tensor,
                     K: int) -> dict[torch.Tensor, torch.Tensor]:
    """Per-sample gradients of ``nn.Conv1d/2d/3d``, summed over each sample's K rows.

    Handles stride, dilation, groups (depthwise included), integer/tuple/``"same"``/``"valid"``
    padding and every ``padding_mode``; the weight gradient is the weight gradient of one grouped
    convolution over the samples (see the module docstring), summed over the K copies.

    >>> conv = nn.Conv2d(2, 3, 3, padding="same", padding_mode="reflect")
    >>> x = torch.randn(4, 2, 5, 5)  # N=2 samples, K=2 copies each
    >>> grads = conv_grad_sample(conv, [x], torch.randn(4, 3, 5, 5), K=2)
    >>> grads[conv.weight].shape, grads[conv.bias].shape
    (torch.Size([2, 3, 2, 3, 3]), torch.Size([2, 3]))
    """
    return _weight_and_bias(layer, activations[0], backprops, K)


@register_grad_sampler(nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d, k_aware=True,
                       batch_first_only=True)
def conv_transpose_grad_sample(layer: _ConvTransposeLayer, activations: list[torch.Tensor],
                               backprops: torch.Tensor, K: int) -> dict[torch.Tensor, torch.Tensor]:
    """Per-sample gradients of ``nn.ConvTranspose1d/2d/3d``, summed over each sample's K rows.

    Handles stride, padding, ``output_padding`` (or ``output_size`` at call time), dilation and
    groups: the output gradient is unfolded as a convolution's input and contracted with the
    layer's input over the K copies and the input positions.

    >>> deconv = nn.ConvTranspose2d(2, 4, 3, stride=2, output_padding=1)
    >>> x = torch.randn(6, 2, 4, 4)  # N=3 samples, K=2 copies each
    >>> grads = conv_transpose_grad_sample(deconv, [x], torch.randn(6, 4, 10, 10), K=2)
    >>> grads[deconv.weight].shape
    torch.Size([3, 2, 4, 3, 3])
    """
    return _weight_and_bias(layer, activations[0], backprops, K)


# ------------------------------------------------------------------------------------ ghost norm
def _conv_positions(layer: _ConvLayer | _ConvTransposeLayer, x: torch.Tensor, output: Any,
                    batch_dim: int) -> int | None:
    """The factor rows of one input row: output positions of a convolution, input positions of a
    transposed one (its patches are unfolded from the output gradient)."""
    if isinstance(layer, (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)):
        return math.prod(x.shape[2:])
    return math.prod(output.shape[2:]) if isinstance(output, torch.Tensor) else None


def _conv_weight_sum(layer: _ConvLayer | _ConvTransposeLayer, activation: torch.Tensor,
                     backprop: torch.Tensor) -> torch.Tensor:
    return conv_weight_sum(layer, activation.to(backprop.dtype), backprop).to(layer.weight.dtype)


def _conv_gram_is_cheaper(layer: _ConvLayer | _ConvTransposeLayer, positions: int) -> bool:
    """The ``rule`` between the Gram pair and the materialised weight, per group of O output and I
    patch entries over T positions: the Grams take ``T^2 (I + O)`` multiply-adds per sample and the
    clipped sum then needs the weight-gradient kernel (``O I T``), while a materialised gradient
    costs ``O I T`` once and its clipped sum is one small contraction; so the Gram pair when
    ``T (I + O) <= O I`` (at most twice the work). That also keeps its ``2 T^2`` numbers below the
    ``O I`` of the materialised weight (``(I + O)^2 >= 4 O I``). A bound on memory alone picked the
    Grams on wide layers where they cost 2.5x the time (a 192-channel 3x3 layer at 16x16, T 256).
    The GPU measures instead (``auto``)."""
    weight = layer.weight  # (O * G, I / prod(k), *k) for either kind (a transposed conv's O is C_in / G)
    per_group_out = max(weight.shape[0] // layer.groups, 1)
    per_group_in = weight.numel() // (layer.groups * per_group_out)
    return positions * (per_group_in + per_group_out) <= per_group_in * per_group_out


def _conv_prefers_gram(layer: _ConvLayer | _ConvTransposeLayer, activation: torch.Tensor,
                       backprop: torch.Tensor, K: int) -> bool | None:
    """Ghost clipping's choice for one call: the Gram pair (True) or the materialised per-sample
    gradient (False); None leaves it to :func:`_conv_gram_is_cheaper` (strategy ``rule``).

    ``auto`` times the three ways on the call's tensors, each with what it costs later in the
    step: the Gram pair's norms plus the weight-gradient kernel of its clipped sum, or a
    materialised gradient (``grouped_conv`` or ``unfold``) and its norm.
    """
    device = backprop.device
    mode = current_conv_strategy(device)
    applicable = _applicable(layer)
    if mode is ConvStrategy.GRAM:
        return True
    if mode in applicable:
        return False
    if mode is not ConvStrategy.AUTO:
        return None
    sizes = _Sizes.of(layer, activation, backprop, K)
    allowed = admissible(sizes.ghost_footprints(applicable), sizes.activations)
    candidates = {s: functools.partial(_ghost_candidate, s, layer, activation, backprop, K)
                  for s in _measurable(allowed, device)}
    choice = choose_measured(_signature("ghost", layer, activation, backprop, K), candidates, device)
    if choice is not ConvStrategy.GRAM and all(s in allowed for s in _measurable(list(applicable), device)):
        # The materialised gradient will come from the grad sampler: it need not measure again.
        seed_cache(_signature("per_sample", layer, activation, backprop, K), choice)
    return choice is ConvStrategy.GRAM


def _ghost_candidate(strategy: ConvStrategy, layer: _ConvLayer | _ConvTransposeLayer, activation: torch.Tensor,
                     backprop: torch.Tensor, K: int) -> None:
    """One way of getting ghost's per-sample norms of a conv weight (for timing only)."""
    if strategy is ConvStrategy.GRAM:
        factors, _ = conv_ghost_factors(layer, activation, backprop, K)
        factors.sq_norms(torch.float32)  # (N,)
        _conv_weight_sum(layer, activation, backprop)  # the clipped sum's kernel, later in the step
        return
    grad = _PER_SAMPLE[strategy](layer, activation, backprop, K)  # (N, *weight)
    torch.linalg.vector_norm(grad.flatten(1), dim=1)  # (N,)


@register_ghost_norm(nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
                     nn.ConvTranspose3d, weight_sum=_conv_weight_sum, positions=_conv_positions,
                     is_cheaper=_conv_gram_is_cheaper, choose=_conv_prefers_gram, layout=WeightLayout.ROWS_RIGHT,
                     linear_in_input=True)
def conv_ghost_factors(layer: _ConvLayer | _ConvTransposeLayer, activation: torch.Tensor,
                       backprop: torch.Tensor, K: int) -> tuple[GhostFactors, dict[torch.Tensor, torch.Tensor]]:
    """The unfolded factors of :func:`conv_weight_factors`, one Gram pair per group.

    >>> conv = nn.Conv2d(4, 6, 3, groups=2)
    >>> factors, others = conv_ghost_factors(conv, torch.randn(4, 4, 5, 5), torch.randn(4, 6, 3, 3), 2)
    >>> factors.left.shape, factors.right.shape, others[conv.bias].shape
    (torch.Size([2, 2, 18, 18]), torch.Size([2, 2, 18, 3]), torch.Size([2, 6]))
    """
    patches, other = conv_weight_factors(layer, activation, backprop, K)  # (N, G, I, K*L), (N, G, O, K*L)
    factors = GhostFactors.dot(patches.transpose(-1, -2), other.transpose(-1, -2))  # (N, G, K*L, .)
    bias = {layer.bias: fold_rows(backprop.flatten(2), K).sum((1, 3))} if wants_grad(layer.bias) else {}  # (N, C_out)
    return factors, bias
