"""Per-sample gradients of :class:`psg_core.layers.SequenceBias` (``add_bias_kv`` of attention)."""

from __future__ import annotations

import torch

from psg_core.grad_sample._utils import wants_grad
from psg_core.grad_sample.registry import register_grad_sampler
from psg_core.layers.attention import SequenceBias
from psg_core.layout import fold_rows


@register_grad_sampler(SequenceBias, k_aware=True)
def sequence_bias_grad_sample(layer: SequenceBias, activations: list[torch.Tensor],
                              backprops: torch.Tensor, K: int) -> dict[torch.Tensor, torch.Tensor]:
    """The bias is the appended last step, so its gradient is that step's backprop, summed over K."""
    if not wants_grad(layer.bias):
        return {}
    g = fold_rows(backprops[:, -1], K)  # (N, K, E): backprops arrive batch-first, (N*K, T+1, E)
    return {layer.bias: g.sum(1)}  # (N, E)
