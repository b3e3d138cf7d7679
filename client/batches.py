"""Cutting a logical batch into the parts of one accumulated step (``ComputeGradientsHeader.part``):
whole samples (K rows each) per part, as many as a row budget and a byte budget allow.

>>> import torch
>>> named = [("inputs/0", torch.zeros(10, 4)), ("targets", torch.zeros(10, dtype=torch.int64))]
>>> [[tuple(t.shape) for _, t in part] for part in split_named_batch(named, max_rows=4)]
[[(4, 4), (4,)], [(4, 4), (4,)], [(2, 4), (2,)]]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from psg_core.errors import ConfigError
from psg_wire.names import TARGETS

__all__ = ["split_named_batch"]


def _batch_dim(tensor: torch.Tensor, batch_dim: int) -> int:
    # A tensor without the batch dimension's axis (the (N*K,) class labels of a time-major model)
    # carries the batch on dimension 0, as the server reads it.
    return batch_dim if tensor.dim() > batch_dim else 0


def split_named_batch(named: Sequence[tuple[str, torch.Tensor]], *, max_rows: int | None = None,
                      max_bytes: int | None = None, augmentation_multiplicity: int = 1,
                      batch_first: bool = True) -> list[list[tuple[str, torch.Tensor]]]:
    """The parts of a batch (``(wire name, tensor)`` pairs, inputs and targets): views of at most
    ``max_rows`` rows and ``max_bytes`` tensor bytes each, whole samples only; the batch as its only
    part when it fits (or no budget is given), an empty batch included.

    Args:
        named: every tensor of the batch, each with the batch's N*K rows on the batch dimension.
        max_rows: most rows (N*K) per part; None = no row budget.
        max_bytes: most tensor bytes per part; None = no byte budget.
        augmentation_multiplicity: K, rows per sample (never split across parts).
        batch_first: the batch dimension is 0 (True) or 1 (False).

    Raises:
        ConfigError: a budget is below one sample, or the tensors disagree on the rows.
    """
    where = "compute_gradients"
    K = augmentation_multiplicity
    dim = 0 if batch_first else 1
    by_name = dict(named)
    if TARGETS not in by_name:
        raise ConfigError(f"{where}: the batch has no {TARGETS!r} tensor")
    targets = by_name[TARGETS]
    rows = int(targets.shape[_batch_dim(targets, dim)]) if targets.dim() else 0
    for name, tensor in named:
        if tensor.dim() == 0 or tensor.shape[_batch_dim(tensor, dim)] != rows:
            raise ConfigError(f"{where}: {name!r} has shape {list(tensor.shape)}; every tensor needs the batch's "
                              f"{rows} rows on dimension {dim}")
    if rows == 0 or rows % K or (max_rows is None and max_bytes is None):
        return [list(named)]  # (rows K does not divide: the server refuses the batch as it is)
    num_samples = rows // K
    per_part = num_samples
    if max_rows is not None:
        if max_rows < K:
            raise ConfigError(f"{where}: max_rows={max_rows} is below one sample's {K} rows")
        per_part = min(per_part, max_rows // K)
    if max_bytes is not None:
        sample_bytes = sum(t.numel() * t.element_size() for _, t in named) * K // rows
        if max_bytes < sample_bytes:
            raise ConfigError(f"{where}: max_bytes={max_bytes} is below one sample's {sample_bytes} bytes")
        per_part = min(per_part, max_bytes // max(sample_bytes, 1))
    if per_part >= num_samples:
        return [list(named)]
    return [[(name, tensor.narrow(_batch_dim(tensor, dim), start * K, min(per_part, num_samples - start) * K))
             for name, tensor in named]
            for start in range(0, num_samples, per_part)]
