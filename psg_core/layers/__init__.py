"""DP rewrites of fused layers: every trainable parameter sits in a layer with a grad sampler.

>>> import torch
>>> from psg_core.layers import DPLSTM
>>> DPLSTM(3, 4, batch_first=True)(torch.zeros(2, 5, 3))[0].shape
torch.Size([2, 5, 4])
"""

from __future__ import annotations

from psg_core.layers.attention import DPMultiheadAttention, SequenceBias
from psg_core.layers.recurrent import (DPGRU, DPLSTM, DPRNN, DPGRUCell, DPLSTMCell, DPRNNCell,
                                       RNNLinear)

__all__ = [
    "DPGRU",
    "DPGRUCell",
    "DPLSTM",
    "DPLSTMCell",
    "DPMultiheadAttention",
    "DPRNN",
    "DPRNNCell",
    "RNNLinear",
    "SequenceBias",
]
