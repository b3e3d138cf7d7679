"""Small tensor helpers shared by the grad samplers."""

from __future__ import annotations

import torch

__all__ = ["split_k", "wants_grad"]


def split_k(tensor: torch.Tensor, augmentation_multiplicity: int) -> torch.Tensor:
    """Views ``(N*K, ...)`` as ``(N, K, ...)`` (rows are sample-major). No copy."""
    rows = tensor.shape[0]
    return tensor.reshape(rows // augmentation_multiplicity, augmentation_multiplicity,
                          *tensor.shape[1:])


def wants_grad(param: torch.Tensor | None) -> bool:
    """True for a parameter that exists and is trainable."""
    return param is not None and param.requires_grad
