"""Per-sample gradients of ``nn.Linear``."""

from __future__ import annotations

import math

import torch
from opt_einsum import contract
from torch import nn

from psg_core.grad_sample._utils import wants_grad
from psg_core.grad_sample.registry import register_grad_sampler


@register_grad_sampler(nn.Linear)
def linear_grad_sample(layer: nn.Linear, activations: list[torch.Tensor], backprops: torch.Tensor,
                       K: int) -> dict[torch.Tensor, torch.Tensor]:
    """``W`` gets ``sum_{k,t} g x^T`` per sample; works for any number of middle (sequence) dims.

    Sample n's K rows and their positions are consecutive in memory, so they merge into one axis
    of ``K*T`` rows (a view) and the weight gradient is one batched matmul over it; contracting
    ``k`` and ``t`` as separate axes makes einsum permute, or broadcast-multiply when T = 1.
    """
    n_samples = backprops.shape[0] // K
    rows_per_sample = K * math.prod(backprops.shape[1:-1])  # explicit: N may be 0
    x = activations[0].reshape(n_samples, rows_per_sample, activations[0].shape[-1])  # (N, K*T, d_in)
    g = backprops.reshape(n_samples, rows_per_sample, backprops.shape[-1])  # (N, K*T, d_out)
    out: dict[torch.Tensor, torch.Tensor] = {}
    if wants_grad(layer.weight):
        out[layer.weight] = contract("njo,nji->noi", g, x)  # (N, d_out, d_in)
    if wants_grad(layer.bias):
        out[layer.bias] = g.sum(1)  # (N, d_out)
    return out
