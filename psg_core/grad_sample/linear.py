"""Per-sample gradients of ``nn.Linear``."""

from __future__ import annotations

import torch
from opt_einsum import contract
from torch import nn

from psg_core.grad_sample._utils import split_k, wants_grad
from psg_core.grad_sample.registry import register_grad_sampler


@register_grad_sampler(nn.Linear)
def linear_grad_sample(layer: nn.Linear, activations: list[torch.Tensor], backprops: torch.Tensor,
                       K: int) -> dict[nn.Parameter, torch.Tensor]:
    """``W`` gets ``sum_{k,t} g x^T`` per sample; works for any number of middle (sequence) dims."""
    x = split_k(activations[0], K)  # (N, K, *, d_in)
    g = split_k(backprops, K)  # (N, K, *, d_out)
    out: dict[nn.Parameter, torch.Tensor] = {}
    if wants_grad(layer.weight):
        out[layer.weight] = contract("nk...o,nk...i->noi", g, x)  # (N, d_out, d_in)
    if wants_grad(layer.bias):
        out[layer.bias] = contract("nk...o->no", g)  # (N, d_out)
    return out
