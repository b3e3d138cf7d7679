"""Per-sample gradients and ghost norms of ``nn.Linear`` and of transformers' ``Conv1D``.

transformers' ``Conv1D`` (GPT-2's projections) is a Linear layer with its weight stored
transposed, ``(d_in, d_out)``: ``y = x @ W + b``. It is registered by name, so psg_core does not
import transformers; the registry resolves the name once the model has imported it.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch
from torch import nn

from psg_core.gemm import mm_tn
from psg_core.grad_sample._utils import accumulation_target, adds_into_targets, wants_grad
from psg_core.grad_sample.ghost_norm import GhostFactors, WeightLayout, register_ghost_norm
from psg_core.grad_sample.registry import register_grad_sampler
from psg_core.precision import as_dtype

__all__ = ["linear_grad_sample", "linear_ghost_factors", "conv1d_grad_sample", "conv1d_ghost_factors",
           "TRANSFORMERS_CONV1D"]

#: transformers' GPT-2 projection layer, by name (see the module docstring).
TRANSFORMERS_CONV1D = "transformers.pytorch_utils.Conv1D"


class _AffineLayer(Protocol):
    """What these samplers read of a layer: ``nn.Linear`` or transformers' ``Conv1D``."""

    @property
    def weight(self) -> torch.Tensor: ...

    @property
    def bias(self) -> torch.Tensor | None: ...


def _rows(activation: torch.Tensor, backprop: torch.Tensor, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(N, K*T, d_in)`` and ``(N, K*T, d_out)`` views of a call's input and output gradient.

    Sample n's K rows and their positions are consecutive in memory, so they merge into one axis
    of ``K*T`` rows (a view) and a weight gradient is one batched matmul over it; contracting
    ``k`` and ``t`` as separate axes makes einsum permute, or broadcast-multiply when T = 1.
    """
    n_samples = backprop.shape[0] // K
    rows_per_sample = K * math.prod(backprop.shape[1:-1])  # explicit: N may be 0
    x = activation.reshape(n_samples, rows_per_sample, activation.shape[-1])  # (N, K*T, d_in)
    g = backprop.reshape(n_samples, rows_per_sample, backprop.shape[-1])  # (N, K*T, d_out)
    return x, g


def _bias(layer: _AffineLayer, g: torch.Tensor) -> dict[torch.Tensor, torch.Tensor]:
    """``{bias: (N, d_out)}`` from ``(N, K*T, d_out)`` output gradients, if the bias trains (one row
    per sample, a Linear on ``(N, d)`` inputs: that row, a view, no sum)."""
    if not wants_grad(layer.bias):
        return {}
    return {layer.bias: g.select(1, 0) if g.shape[1] == 1 else g.sum(1)}


def _positions(layer: nn.Module, x: torch.Tensor, output: Any, batch_dim: int) -> int | None:
    """Every middle dim of the input is a position: ``(rows, *T, d_in)`` gives ``prod(T)``."""
    return x.numel() // max(1, x.shape[batch_dim] * x.shape[-1])


def _flat(activation: torch.Tensor, backprop: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows*T, d_in)`` and ``(rows*T, d_out)``, the input in the gradient's dtype."""
    a2 = as_dtype(activation.reshape(-1, activation.shape[-1]), backprop.dtype)  # (rows*T, d_in)
    return a2, backprop.reshape(-1, backprop.shape[-1])  # (rows*T, d_out)


def _one_group_factors(layer: _AffineLayer, activation: torch.Tensor, backprop: torch.Tensor,
                       K: int) -> tuple[GhostFactors, dict[torch.Tensor, torch.Tensor]]:
    """Ghost factors of an affine layer: one group, ``(N, 1, K*T, d_in)`` and ``(N, 1, K*T, d_out)``
    views of the input and output gradient (one reshape each), and the bias's per-sample gradient."""
    n_samples = backprop.shape[0] // K
    rows_per_sample = K * math.prod(backprop.shape[1:-1])  # explicit: N may be 0
    x = activation.reshape(n_samples, 1, rows_per_sample, activation.shape[-1])  # (N, 1, K*T, d_in)
    g = backprop.reshape(n_samples, 1, rows_per_sample, backprop.shape[-1])  # (N, 1, K*T, d_out)
    return GhostFactors.dot(x, g), _bias(layer, g.select(1, 0))  # one group


# ------------------------------------------------------------------------------------ nn.Linear
# psg's RNNLinear (the DP recurrent layers' ih/hh) overrides forward only to reuse an output the
# recurrence computed already: the same function, so the same sampler and ghost norm.
_RNN_LINEAR = "psg_core.layers.recurrent.RNNLinear"


@register_grad_sampler(nn.Linear, _RNN_LINEAR, k_aware=True)
@adds_into_targets
def linear_grad_sample(layer: nn.Linear, activations: list[torch.Tensor], backprops: torch.Tensor,
                       K: int) -> dict[torch.Tensor, torch.Tensor]:
    """``W`` gets ``sum_{k,t} g x^T`` per sample; works for any number of middle (sequence) dims.

    >>> layer = nn.Linear(3, 2)
    >>> grads = linear_grad_sample(layer, [torch.randn(4, 5, 3)], torch.randn(4, 5, 2), K=2)
    >>> grads[layer.weight].shape, grads[layer.bias].shape
    (torch.Size([2, 2, 3]), torch.Size([2, 2]))
    """
    x, g = _rows(activations[0], backprops, K)  # (N, K*T, d_in), (N, K*T, d_out)
    out: dict[torch.Tensor, torch.Tensor] = {}
    if wants_grad(layer.weight):
        g_t = g.transpose(1, 2)  # (N, d_out, K*T)
        # A layer called again in the pass (a shared block, a cell in a loop): the product added
        # into the per-sample gradient the earlier calls made, no (N, d_out, d_in) tensor of its own
        into = accumulation_target(layer.weight, (g.shape[0], g.shape[2], x.shape[2]), g.dtype, g.device) \
            if x.dtype == g.dtype else None
        out[layer.weight] = torch.bmm(g_t, x) if into is None else into.baddbmm_(g_t, x)  # (N, d_out, d_in)
    return out | _bias(layer, g)


def _linear_weight_sum(layer: nn.Linear, activation: torch.Tensor, backprop: torch.Tensor) -> torch.Tensor:
    a2, g2 = _flat(activation, backprop)  # (rows*T, d_in), (rows*T, d_out)
    return as_dtype(mm_tn(g2, a2), layer.weight.dtype)  # (d_out, d_in)


@register_ghost_norm(nn.Linear, _RNN_LINEAR, weight_sum=_linear_weight_sum, positions=_positions,
                     layout=WeightLayout.ROWS_RIGHT, linear_in_input=True)
def linear_ghost_factors(layer: nn.Linear, activation: torch.Tensor, backprop: torch.Tensor,
                         K: int) -> tuple[GhostFactors, dict[torch.Tensor, torch.Tensor]]:
    """Sample n's weight gradient is ``g_n^T x_n`` over its ``K*T`` rows: one group of factors.

    >>> factors, others = linear_ghost_factors(nn.Linear(3, 2), torch.randn(4, 5, 3), torch.randn(4, 5, 2), 2)
    >>> factors.left.shape, factors.right.shape, len(others)
    (torch.Size([2, 1, 10, 3]), torch.Size([2, 1, 10, 2]), 1)
    """
    return _one_group_factors(layer, activation, backprop, K)


# ------------------------------------------------------------------------- transformers' Conv1D
@register_grad_sampler(TRANSFORMERS_CONV1D, k_aware=True)
def conv1d_grad_sample(layer: _AffineLayer, activations: list[torch.Tensor], backprops: torch.Tensor,
                       K: int) -> dict[torch.Tensor, torch.Tensor]:
    """transformers' ``Conv1D``: ``W`` ``(d_in, d_out)`` gets ``sum_{k,t} x g^T`` per sample.

    >>> class Conv1D(nn.Module):  # the shape of transformers.pytorch_utils.Conv1D
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.weight, self.bias = nn.Parameter(torch.randn(3, 2)), nn.Parameter(torch.zeros(2))
    >>> layer = Conv1D()
    >>> conv1d_grad_sample(layer, [torch.randn(4, 5, 3)], torch.randn(4, 5, 2), K=2)[layer.weight].shape
    torch.Size([2, 3, 2])
    """
    x, g = _rows(activations[0], backprops, K)  # (N, K*T, d_in), (N, K*T, d_out)
    out: dict[torch.Tensor, torch.Tensor] = {}
    if wants_grad(layer.weight):
        out[layer.weight] = torch.bmm(x.transpose(1, 2), g)  # (N, d_in, d_out)
    return out | _bias(layer, g)


def _conv1d_weight_sum(layer: _AffineLayer, activation: torch.Tensor, backprop: torch.Tensor) -> torch.Tensor:
    a2, g2 = _flat(activation, backprop)  # (rows*T, d_in), (rows*T, d_out)
    return as_dtype(a2.transpose(0, 1) @ g2, layer.weight.dtype)  # (d_in, d_out)


@register_ghost_norm(TRANSFORMERS_CONV1D, weight_sum=_conv1d_weight_sum, positions=_positions,
                     layout=WeightLayout.ROWS_LEFT, linear_in_input=True)
def conv1d_ghost_factors(layer: _AffineLayer, activation: torch.Tensor, backprop: torch.Tensor,
                         K: int) -> tuple[GhostFactors, dict[torch.Tensor, torch.Tensor]]:
    """The factors of ``nn.Linear``: a transposed weight has the same norm."""
    return _one_group_factors(layer, activation, backprop, K)
