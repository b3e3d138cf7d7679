"""DP rewrites of fused layers: every trainable parameter sits in a layer with a grad sampler.

Names load on first access (PEP 562): ``psg_core.grad_sample`` imports :class:`SequenceBias`
while ``psg_core.backends.hooks`` is still initialising, and the recurrent layers need a constant
from that module, so importing everything eagerly here would close an import cycle.

>>> import torch
>>> from psg_core.layers import DPLSTM
>>> DPLSTM(3, 4, batch_first=True)(torch.zeros(2, 5, 3))[0].shape
torch.Size([2, 5, 4])
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

_MODULE_OF = {
    "DPMultiheadAttention": "attention",
    "SequenceBias": "attention",
    "DPGRU": "recurrent",
    "DPGRUCell": "recurrent",
    "DPLSTM": "recurrent",
    "DPLSTMCell": "recurrent",
    "DPRNN": "recurrent",
    "DPRNNCell": "recurrent",
    "RNNLinear": "recurrent",
}


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
