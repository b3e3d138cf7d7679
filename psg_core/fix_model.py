"""``fix_model``: make a model trainable with per-sample gradients by swapping unsupported layers."""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable
from typing import Any, NotRequired, TypedDict

import torch
from torch import nn

from psg_core.errors import UnsupportedModuleError
from psg_core.layers.attention import DPMultiheadAttention, _from_torch_state_dict
from psg_core.layers.recurrent import (DPGRU, DPLSTM, DPRNN, DPGRUCell, DPLSTMCell, DPRNNCell,
                                       _DPCellBase, _DPRNNBase, _torch_keys_to_cell_keys)

__all__ = ["fix_model"]

logger = logging.getLogger(__name__)

#: Rewrites torch's parameter names into a rewrite's names: ``fn(module, state_dict, prefix)``.
_KeyTranslator = Callable[[nn.Module, dict[str, Any], str], None]

#: Largest group count tried for GroupNorm, the usual default (Wu & He, 2018).
_MAX_GROUPS = 32


class _Factory(TypedDict, total=False):
    """Factory keyword arguments that put a replacement where the original's parameters are."""

    device: torch.device
    dtype: torch.dtype


class _RecurrentArgs(TypedDict):
    """The constructor arguments DPRNN, DPGRU and DPLSTM share with their torch originals."""

    input_size: int
    hidden_size: int
    num_layers: int
    bias: bool
    batch_first: bool
    dropout: float
    bidirectional: bool
    device: NotRequired[torch.device]
    dtype: NotRequired[torch.dtype]


def fix_model(model: nn.Module) -> nn.Module:
    """A copy of ``model`` in which every layer that hooks cannot handle is replaced.

    * ``BatchNorm1d/2d/3d`` (and ``SyncBatchNorm``) -> ``GroupNorm(gcd(32, C), C)`` with the same
      ``eps`` and, when affine, the same weight and bias. BatchNorm mixes the samples of a batch,
      so it has no per-sample gradient; GroupNorm normalises each sample on its own. **Outputs
      change**: this is a different normalisation (running statistics are dropped), so fine-tune
      or train the fixed model rather than expect the original's predictions.
    * ``nn.RNN``/``nn.GRU``/``nn.LSTM`` -> :class:`~psg_core.layers.DPRNN`/``DPGRU``/``DPLSTM``,
      their cells -> ``DPRNNCell``/``DPGRUCell``/``DPLSTMCell``, and ``nn.MultiheadAttention`` ->
      :class:`~psg_core.layers.DPMultiheadAttention`, with weights copied: outputs are unchanged
      (up to floating point rounding).

    Dtype, device, ``requires_grad`` flags and train/eval mode carry over. A module used in
    several places gets one replacement used in all of them. ``model`` itself is not modified.

    Raises:
        UnsupportedModuleError: for an ``nn.LSTM`` with ``proj_size > 0``, or a lazy module that
            has not seen data yet.

    >>> model = nn.Sequential(nn.Conv1d(2, 8, 3), nn.BatchNorm1d(8), nn.LSTM(4, 4))
    >>> fixed = fix_model(model)
    >>> [type(m).__name__ for m in fixed]
    ['Conv1d', 'GroupNorm', 'DPLSTM']
    """
    if not isinstance(model, nn.Module):
        raise UnsupportedModuleError(f"fix_model: expected an nn.Module, got {type(model).__name__}")
    for path, module in model.named_modules():
        # torch types the method's self as a protocol that the mixin itself does not declare.
        if isinstance(module, nn.modules.lazy.LazyModuleMixin) and \
                module.has_uninitialized_params():  # type: ignore[misc]
            raise UnsupportedModuleError(
                f"fix_model: {path or '<root>'} ({type(module).__name__}) has not seen data yet, so "
                "its shapes are unknown; run one forward pass before fix_model")
    fixed = copy.deepcopy(model)
    return _fix(fixed, "", {})


def _fix(module: nn.Module, path: str, done: dict[int, nn.Module]) -> nn.Module:
    """Returns ``module``'s replacement, or ``module`` itself with its children fixed in place."""
    if id(module) in done:
        return done[id(module)]
    replacement = _replacement(module, path or "<root>")
    if replacement is None:
        done[id(module)] = module
        for name, child in list(module.named_children()):
            new_child = _fix(child, f"{path}.{name}" if path else name, done)
            if new_child is not child:
                setattr(module, name, new_child)
        if isinstance(module, nn.TransformerEncoder) and any(
                isinstance(m, DPMultiheadAttention) for m in module.modules()):
            # Its nested-tensor inference path reads the fused in_proj_weight directly.
            module.use_nested_tensor = False
        return module
    replacement.train(module.training)
    logger.debug("fix_model: replaced %s (%s) with %s", path or "<root>", type(module).__name__,
                 type(replacement).__name__)
    done[id(module)] = replacement
    return replacement


def _replacement(module: nn.Module, where: str) -> nn.Module | None:
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return _group_norm(module)
    if isinstance(module, nn.RNNBase):
        return _recurrent(module, where)
    if isinstance(module, nn.RNNCellBase):
        return _recurrent_cell(module)
    if isinstance(module, nn.MultiheadAttention):
        return _attention(module)
    return None


def _factory(module: nn.Module) -> _Factory:
    first = next(iter(module.parameters()), None)
    return {} if first is None else {"device": first.device, "dtype": first.dtype}


def _copy_weights(source: nn.Module, target: nn.Module, translate: _KeyTranslator) -> None:
    """Loads ``source``'s state dict (torch key names) into ``target``; frozen stays frozen."""
    target.load_state_dict(source.state_dict())
    frozen = {name: p.detach() for name, p in source.named_parameters() if not p.requires_grad}
    translate(target, frozen, "")  # torch names -> the rewrite's names, in place
    for name in frozen:
        target.get_parameter(name).requires_grad_(False)


def _group_norm(norm: nn.modules.batchnorm._BatchNorm) -> nn.GroupNorm:
    channels = norm.num_features
    group_norm = nn.GroupNorm(math.gcd(_MAX_GROUPS, channels), channels, eps=norm.eps,
                              affine=norm.affine, **_factory(norm))
    if norm.affine:
        with torch.no_grad():
            group_norm.weight.copy_(norm.weight)
            group_norm.bias.copy_(norm.bias)
        group_norm.weight.requires_grad_(norm.weight.requires_grad)
        group_norm.bias.requires_grad_(norm.bias.requires_grad)
    return group_norm


def _recurrent(rnn: nn.RNNBase, where: str) -> _DPRNNBase:
    if getattr(rnn, "proj_size", 0):
        raise UnsupportedModuleError(
            f"fix_model: {where} is an LSTM with proj_size={rnn.proj_size}, which DPLSTM does not "
            "support; use proj_size=0 (optionally followed by an nn.Linear)")
    common: _RecurrentArgs = {
        "input_size": rnn.input_size, "hidden_size": rnn.hidden_size, "num_layers": rnn.num_layers,
        "bias": rnn.bias, "batch_first": rnn.batch_first, "dropout": rnn.dropout,
        "bidirectional": rnn.bidirectional, **_factory(rnn)}
    replacement: _DPRNNBase
    if rnn.mode in ("RNN_TANH", "RNN_RELU"):
        replacement = DPRNN(nonlinearity="tanh" if rnn.mode == "RNN_TANH" else "relu", **common)
    elif rnn.mode == "GRU":
        replacement = DPGRU(**common)
    elif rnn.mode == "LSTM":
        replacement = DPLSTM(**common)
    else:
        raise UnsupportedModuleError(f"fix_model: {where} has unknown recurrent mode {rnn.mode!r}")
    _copy_weights(rnn, replacement, _torch_keys_to_cell_keys)
    return replacement


def _recurrent_cell(cell: nn.RNNCellBase) -> _DPCellBase:
    factory = _factory(cell)
    replacement: _DPCellBase
    if isinstance(cell, nn.LSTMCell):
        replacement = DPLSTMCell(cell.input_size, cell.hidden_size, cell.bias, **factory)
    elif isinstance(cell, nn.GRUCell):
        replacement = DPGRUCell(cell.input_size, cell.hidden_size, cell.bias, **factory)
    else:
        nonlinearity = getattr(cell, "nonlinearity", "tanh")
        replacement = DPRNNCell(cell.input_size, cell.hidden_size, cell.bias, nonlinearity,
                                **factory)
    _copy_weights(cell, replacement, _torch_keys_to_cell_keys)
    return replacement


def _attention(attention: nn.MultiheadAttention) -> DPMultiheadAttention:
    replacement = DPMultiheadAttention(
        attention.embed_dim, attention.num_heads, dropout=attention.dropout,
        bias=attention.in_proj_bias is not None, add_bias_kv=attention.bias_k is not None,
        add_zero_attn=attention.add_zero_attn, kdim=attention.kdim, vdim=attention.vdim,
        batch_first=attention.batch_first, **_factory(attention))
    _copy_weights(attention, replacement, _from_torch_state_dict)
    return replacement
