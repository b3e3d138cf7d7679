"""Per-sample gradients of routed experts, from one call on per-sample copies of the experts.

A routed-experts module (Hugging Face's Mixtral, Qwen-MoE, OLMoE, DeepSeek experts: see
:func:`psg_core.provenance.rowwise_module`) holds every expert's weights stacked on axis 0,
``(E, ...)``, and sends each token row to the experts its routing index names. Give each sample
its own copy of the experts, ``(N*E, ...)`` with copy ``n*E + e`` equal to expert ``e``, and send
sample n's rows to copy ``n*E + e`` instead of ``e``: the call computes the same outputs, and the
gradient of each copy is one sample's gradient of its expert. One forward and backward of the
module on its usual rows (the grouped kernels take N*E groups instead of E) replaces the N calls
of the per-layer ``torch.func`` fallback, which a routed module needs (its sort and data-dependent
offsets defeat ``vmap``).

The copies run through transformers' grouped forward (whichever implementation the model was
configured with: they all compute the same function), with the module's own flags, activation
and gate; psg only swaps its parameters and its expert count. A module whose
forward does not route through those (an expert count read from elsewhere, a parameter not
stacked by expert) would compute something else: on the first call of each class (and experts
implementation, device type and dtype) the copies' outputs are checked against the module's own
before their gradients are used; a class that fails the check, or a module that does not look
like routed experts, gets ``None`` (the caller runs the fallback, one sample at a time).
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from psg_core.support import EXPERTS_INTERFACE, built_on_experts_interface

__all__ = ["routed_experts_grad_sample"]

#: The attribute a routed-experts module counts its experts in (transformers' experts interface).
EXPERT_COUNT = "num_experts"

#: (class, experts implementation, device type, dtype) -> whether the copies' outputs were the
#: module's own on its first call there (checked once per process, as the code path is the class's).
_CHECKED: dict[tuple[type, str, str, torch.dtype], bool] = {}


def routed_experts_grad_sample(layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                               backprops: Sequence[torch.Tensor | None], augmentation_multiplicity: int,
                               rows: int, input_dims: Sequence[tuple[int, int] | None]
                               ) -> dict[torch.Tensor, torch.Tensor] | None:
    """``{parameter: (N, *parameter.shape)}`` for the layer's own trainable parameters, or None
    where the layer is not routed experts this can run (see the module docstring).

    Args:
        layer: the routed-experts module, as called in the forward pass.
        args, kwargs: its inputs (detached): the token rows, the routing index (the one integer
            tensor), the routing weights.
        backprops: the gradient of its one output (token rows on axis 0).
        augmentation_multiplicity: K.
        rows: N*K, the batch's rows.
        input_dims: ``(axis, entries per row)`` of each flattened input as the tracker followed it
            (None: batch-free).
    """
    experts = getattr(layer, EXPERT_COUNT, None)
    forward = _grouped_forward(layer)
    if forward is None or not isinstance(experts, int) or isinstance(experts, bool) or experts < 1:
        return None
    if len(backprops) != 1 or backprops[0] is None or rows % augmentation_multiplicity:
        return None
    grad = backprops[0]
    own = dict(layer.named_parameters(recurse=False))
    trainable = [name for name, p in own.items() if p.requires_grad]
    if not trainable or any(p.dim() == 0 or p.shape[0] != experts for p in own.values()):
        return None
    flat, spec = tree_flatten((args, kwargs))
    if len(input_dims) != len(flat):
        return None
    tokens = grad.shape[0] if grad.dim() else 0
    batched = [i for i, d in enumerate(input_dims) if d is not None]
    if tokens == 0 or tokens % rows or any(input_dims[i] != (0, tokens // rows) or flat[i].shape[0] != tokens
                                           for i in batched):
        return None
    index = [i for i in batched if not flat[i].is_floating_point() and not flat[i].is_complex()]
    if len(index) != 1:
        return None
    samples = rows // augmentation_multiplicity
    route = flat[index[0]]
    # A token row's sample: rows are sample-major, ``tokens // rows`` entries per batch row.
    sample = torch.arange(tokens, device=route.device).div_(tokens // samples, rounding_mode="floor")
    sample = sample.view(-1, *([1] * (route.dim() - 1)))
    valid = (route >= 0) & (route < experts)
    # Entries outside 0..E-1 (expert-parallel sentinels) stay outside: N*E is past every copy.
    flat[index[0]] = torch.where(valid, route + sample * experts, samples * experts)

    replica = copy.copy(layer)  # its own parameter table and expert count; the module is not touched
    replica._parameters = dict(layer._parameters)
    copies = {}
    with torch.enable_grad():
        for name, p in own.items():
            copies[name] = p.detach().repeat(samples, *([1] * (p.dim() - 1))).requires_grad_(p.requires_grad)
            replica._parameters[name] = copies[name]  # type: ignore[assignment]
        setattr(replica, EXPERT_COUNT, samples * experts)
        call_args, call_kwargs = tree_unflatten(flat, spec)
        try:
            out = forward(replica, *call_args, **call_kwargs)
        except RuntimeError:
            return None  # what the grouped kernels refuse (rows not 16-byte aligned), the fallback runs
        if not isinstance(out, torch.Tensor) or out.shape != grad.shape:
            return None
        key = (type(layer), _implementation(layer), out.device.type, out.dtype)
        verdict = _CHECKED.get(key)
        if verdict is None:
            with torch.no_grad():
                expected = layer.forward(*args, **kwargs)
            verdict = _CHECKED[key] = _same(out.detach(), expected)
        if not verdict:
            return None
        grads = torch.autograd.grad((out * grad.to(out.dtype)).sum(), [copies[name] for name in trainable])
    return {own[name]: g.view(samples, *own[name].shape) for name, g in zip(trainable, grads)}


def _same(got: torch.Tensor, expected: Any) -> bool:
    """Whether the copies' outputs are the module's own, up to the rounding of another grouping."""
    if not isinstance(expected, torch.Tensor) or expected.shape != got.shape:
        return False
    half = got.dtype in (torch.float16, torch.bfloat16)
    scale = float(expected.abs().max()) if expected.numel() else 0.0
    return bool(torch.allclose(got.float(), expected.float(), rtol=1e-2 if half else 1e-4,
                               atol=(1e-2 if half else 1e-5) * scale))


def _implementation(layer: nn.Module) -> str:
    return str(getattr(getattr(layer, "config", None), "_experts_implementation", None))


def _grouped_forward(layer: nn.Module) -> Any:
    """transformers' grouped experts forward for a class built on its experts interface (None for
    any other class). It computes what every implementation of the interface computes, in one
    grouped product per projection, where the eager one loops over the experts and the batched one
    gathers an expert's weights per token: over N*E copies, those cost N times more."""
    if not built_on_experts_interface(type(layer)):
        return None
    return getattr(sys.modules.get(EXPERTS_INTERFACE), "grouped_mm_experts_forward", None)
