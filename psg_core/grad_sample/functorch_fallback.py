"""Per-layer ``torch.func`` fallback: per-sample gradients of one module's own parameters.

Used by the hooks backend for modules without a registered sampler (``strict=False``) and for
every module under ``force_functorch=True``. One vmapped item is one sample's K rows.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import nn
from torch.func import functional_call, grad, vjp, vmap
from torch.utils._pytree import tree_flatten, tree_unflatten

from psg_core.errors import PsgError, UnsupportedModuleError
from psg_core.layout import fold_rows
from psg_core._host import capturing
from psg_core.support import (GLOBAL_ATTENTION_NAMES, CallState, is_unit, parametrized, rng_replayed,
                              state_of_call)

__all__ = ["functorch_layer_grad_sample"]


def _is_batched(value: Any, batch_dim: int, rows: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > batch_dim and value.shape[batch_dim] == rows


def _batch_axis(value: Any, followed: tuple[int, int] | None, batch_dim: int, rows: int
                ) -> tuple[int, int] | None:
    """Where to split ``value`` into samples, ``(axis, entries per row)`` (None: shared by every
    sample): where the tracker followed the batch, else (an axis it lost, or no tracker) on
    ``batch_dim`` when the size matches."""
    if followed is None:
        # Batch-free; but one broadcast to the batch's rows (``pe.expand(B, -1)``, XLNet's
        # relative positions) is every sample's own copy, as a sample's forward alone builds it.
        return (batch_dim, 1) if _is_batched(value, batch_dim, rows) and value.stride(batch_dim) == 0 else None
    if followed[0] >= 0:
        return followed
    return (batch_dim, 1) if _is_batched(value, batch_dim, rows) else None


#: Forward hooks that only mark a layer's output as requiring grad: transformers' and peft's
#: ``enable_input_require_grads`` (which activation checkpointing turns on for the input embeddings),
#: by their functions' names. The per-sample run leaves them out (see functorch_layer_grad_sample).
_INPUT_GRAD_HOOKS = frozenset({"make_inputs_require_grads", "make_inputs_require_grad"})


def functorch_layer_grad_sample(layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                                backprops: list[torch.Tensor | None], augmentation_multiplicity: int,
                                batch_dim: int, rows: int, output_dims: Sequence[tuple[int, int]] | None = None,
                                input_dims: Sequence[tuple[int, int] | None] | None = None,
                                state: CallState | None = None, output_index: Sequence[int] | None = None
                                ) -> dict[torch.Tensor, torch.Tensor]:
    """Per-sample gradients of ``layer``'s own trainable parameters (not its submodules').

    Args:
        layer: the module, as called in the forward pass.
        args, kwargs: its inputs (detached), in the model's layout.
        backprops: gradient of the loss w.r.t. each tensor the layer returned (flattened with
            pytree), or None for outputs the loss does not depend on.
        augmentation_multiplicity: K.
        batch_dim: 0 (batch first) or 1.
        rows: N*K, the number of rows in the batch.
        output_dims: ``(batch axis, entries per row)`` of each output with a gradient (as the
            forward pass put it: a layer may move the batch, reduce the axis before it, or return
            rows merged with another axis); default ``(batch_dim, 1)``.
        input_dims: ``(batch axis, entries per row)`` of each tensor among the flattened
            ``(args, kwargs)`` as the forward pass followed it, None for a batch-free one, the axis
            UNKNOWN where it was not followed; default: judged by size.
        state: the state the layer's call began with (see :func:`~psg_core.support.call_state`):
            each sample's run begins with it too, and the layer gets back what it held after.
        output_index: the positions, among the layer's flattened output, of the outputs
            ``backprops`` belong to (the backend hooks only outputs that require grad and hold
            the batch: an integer routing index returned before them is none of them); default:
            the tensors of the output, in order.

    Returns:
        ``{parameter: (N, *parameter.shape)}``, gradients of each sample's summed row losses.
    """
    K = augmentation_multiplicity
    named = _own_named_parameters(layer)
    params = {name: p.detach() for name, p in named.items() if p.requires_grad}
    if not params:
        return {}

    flat_inputs, input_spec = tree_flatten((args, kwargs))
    followed: Sequence[tuple[int, int] | None] = (input_dims if input_dims is not None
                                                  else [(-1, 1)] * len(flat_inputs))
    splits = [_batch_axis(v, f, batch_dim, rows) for v, f in zip(flat_inputs, followed)]
    axes = [None if s is None else s[0] for s in splits]
    in_dims = [None if a is None else 0 for a in axes]
    # A sample is K rows (K * m entries where a view merged m entries into each row).
    batched_inputs = [v if s is None else fold_rows(v.movedim(s[0], 0), K * s[1])  # (N, K*m, ...)
                      for v, s in zip(flat_inputs, splits)]
    out_dims = list(output_dims) if output_dims is not None else [(batch_dim, 1)] * len(backprops)
    bp_dims = [0 if b is not None else None for b in backprops]
    batched_bps = [fold_rows(b.movedim(d, 0), K * m) if b is not None else None  # (N, K*m, ...)
                   for b, (d, m) in zip(backprops, out_dims)]

    own_call = _SAMPLE_CALLS.get(f"{type(layer).__module__}.{type(layer).__qualname__}")
    # (their ``output.requires_grad_(True)`` changes no value or gradient, and raises under torch.func)
    hooks = dict(layer._forward_hooks)
    input_grad_hooks = [key for key, hook in hooks.items() if getattr(hook, "__name__", "") in _INPUT_GRAD_HOOKS]

    def sample_loss(sample_params: dict[str, torch.Tensor], inputs: list[Any],
                    bps: list[torch.Tensor | None]) -> torch.Tensor:
        restored = [v if a is None else v.movedim(0, a) for v, a in zip(inputs, axes)]
        call_args, call_kwargs = tree_unflatten(restored, input_spec)
        if own_call is not None:
            call_kwargs = own_call(layer, call_args, call_kwargs)
        # Only the layer's own tensors are swapped: a submodule's parameter tied to one of them
        # (an MLM head's bias, which its decoder Linear also holds) is that submodule's to account.
        flat = tree_flatten(functional_call(layer, sample_params, call_args, call_kwargs, tie_weights=False))[0]
        outputs = ([flat[i] for i in output_index] if output_index is not None
                   else [o for o in flat if isinstance(o, torch.Tensor)])
        total = torch.zeros((), dtype=torch.float32, device=next(iter(sample_params.values())).device)
        for out, bp, (dim, _) in zip(outputs, bps, out_dims):
            if bp is not None:
                cotangent = bp.movedim(0, dim)
                if out.shape != cotangent.shape:
                    # A tensor the forward shared between samples made this sample's output larger
                    # than its rows: a product with the cotangent would broadcast, not pair them.
                    raise ValueError(f"run on one sample's rows it returns shape {tuple(out.shape)} where the "
                                     f"forward pass's output holds {tuple(cotangent.shape)} per sample")
                total = total + (out * cotangent).sum()
        return total

    def one_at_a_time() -> dict[str, torch.Tensor]:
        step = grad(sample_loss)
        results = [step(params, [v if d is None else v[n] for v, d in zip(batched_inputs, in_dims)],
                        [None if b is None else b[n] for b in batched_bps])
                   for n in range(_num_samples(batched_inputs, in_dims, batched_bps))]
        return {name: torch.stack([r[name] for r in results]) for name in params}

    def by_autograd() -> dict[str, torch.Tensor]:
        # The same function, one sample at a time, differentiated by autograd (no torch.func
        # transform): for a layer that runs an autograd.Function torch.func cannot transform.
        results = []
        with torch.enable_grad():
            for n in range(_num_samples(batched_inputs, in_dims, batched_bps)):
                leaves = {name: p.detach().requires_grad_() for name, p in params.items()}
                total = sample_loss(leaves, [v if d is None else v[n] for v, d in zip(batched_inputs, in_dims)],
                                    [None if b is None else b[n] for b in batched_bps])
                found = torch.autograd.grad(total, list(leaves.values()), allow_unused=True) \
                    if total.requires_grad else (None,) * len(leaves)
                results.append({name: torch.zeros_like(leaf) if g is None else g
                                for (name, leaf), g in zip(leaves.items(), found)})
        return {name: torch.stack([r[name] for r in results]) for name in params}

    def replayed() -> dict[str, torch.Tensor]:
        # The call drew random numbers (dropout in training mode), which a sample's run alone would
        # draw otherwise: the whole batch's call is run again with the generators as the call found
        # them (the same draws), and each sample's gradient is the vector-Jacobian product with
        # its own rows' output gradients (the others' zero).
        if capturing():
            raise RuntimeError("its call draws random numbers, which psg replays by resetting the generators: "
                               "a recorded graph cannot")
        rng = cast(CallState, state).rng

        def whole(sample_params: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
            with rng_replayed(rng):
                flat = tree_flatten(functional_call(layer, sample_params, args, kwargs, tie_weights=False))[0]
            outputs = tuple(flat[i] for i in output_index) if output_index is not None else \
                tuple(o for o in flat if isinstance(o, torch.Tensor))
            if not all(_replays(out, kept) for out, kept in zip(outputs, cast(CallState, state).returned)):
                raise UnsupportedModuleError(
                    f"{type(layer).__qualname__} draws random numbers in its call (dropout in training mode), and "
                    "run again from the generators' states at its start it returned other values than in the "
                    "forward pass (another dtype, as under autocast, may draw other masks), so psg cannot "
                    "compute its per-sample gradients; switch its dropout off (model.eval(), or a rate of 0), "
                    "or use mode='functorch'")
            return outputs

        samples = rows // K
        try:
            pulled = vjp(whole, params)
        except RuntimeError as err:
            if not is_transform_limit(err):
                raise
            # (an autograd.Function torch.func cannot transform: PhiMoE's router's multiplier) one
            # forward and one backward per sample, by autograd
            with torch.enable_grad():
                leaves = {name: p.detach().requires_grad_() for name, p in params.items()}
                outputs = whole(leaves)
                cotangents = _own_rows(outputs, backprops, out_dims, samples, K)
                results = []
                for n in range(samples):
                    found = torch.autograd.grad(outputs, list(leaves.values()), [c[n] for c in cotangents],
                                                retain_graph=n < samples - 1, allow_unused=True)
                    results.append({name: torch.zeros_like(leaf) if g is None else g
                                    for (name, leaf), g in zip(leaves.items(), found)})
            return {name: torch.stack([r[name] for r in results]) for name in params}
        outputs, pullback = pulled[0], pulled[1]
        cotangents = _own_rows(outputs, backprops, out_dims, samples, K)
        try:
            return cast(dict[str, torch.Tensor], vmap(lambda c: pullback(tuple(c))[0])(cotangents))
        except RuntimeError as err:
            if not is_vmap_limit(err):
                raise
            looped = [pullback(tuple(c[n] for c in cotangents))[0] for n in range(samples)]
            return {name: torch.stack([r[name] for r in looped]) for name in params}

    for key in input_grad_hooks:
        del layer._forward_hooks[key]
    try:
        with state_of_call(state or CallState()):
            try:
                if state is not None and state.rng is not None:
                    per_sample = replayed()
                elif own_call is not None:  # it reads one sample's values: never batchable
                    per_sample = one_at_a_time()
                else:
                    try:
                        per_sample = vmap(grad(sample_loss), in_dims=(None, in_dims, bp_dims),
                                          randomness="different")(params, batched_inputs, batched_bps)
                    except RuntimeError as err:
                        if not is_vmap_limit(err):
                            raise
                        # vmap cannot batch the layer (an in-place write into a tensor it creates, a
                        # data-dependent shape): the same function, one sample at a time.
                        per_sample = one_at_a_time()
            except RuntimeError as err:
                if not is_transform_limit(err):
                    raise
                per_sample = by_autograd()
    finally:
        if input_grad_hooks:  # (in their places among the others)
            layer._forward_hooks.clear()
            layer._forward_hooks.update(hooks)
    return {named[name]: g for name, g in per_sample.items()}


def _own_global_attention(layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Longformer's (and LED's) self-attention takes ``is_global_attn``, whether any row of the
    *batch* has a global token; one sample's run needs whether its own rows have one (its code
    cannot run with the flag set and no global token)."""
    if not kwargs.get("is_global_attn"):  # (transformers passes it by keyword)
        return kwargs
    rows = _signature(type(layer).forward).bind_partial(layer, *args, **kwargs).arguments.get("is_index_global_attn")
    return kwargs if not isinstance(rows, torch.Tensor) else {**kwargs, "is_global_attn": bool(rows.any())}


@functools.cache
def _signature(forward: Any) -> inspect.Signature:
    return inspect.signature(forward)


#: Per class (by name): the call of one sample's rows, from what the batch's call was given, where
#: the batch's arguments include a flag computed from every row.
_SAMPLE_CALLS = dict.fromkeys(GLOBAL_ATTENTION_NAMES, _own_global_attention)

#: Messages of the errors vmap raises for a function it cannot batch (torch.func's own, an op
#: without a batching rule, or a read of a batched tensor's values: JetMoE's router takes its
#: experts' token counts with ``.tolist()``), which a loop over samples computes.
VMAP_LIMITS = ("data-dependent control flow", ".item()", "vmap:", "vmap ", "Batching rule not implemented",
               "Cannot access data pointer of Tensor that doesn't have storage")


def is_vmap_limit(err: RuntimeError) -> bool:
    """Whether ``err`` is vmap's refusal to batch a function (a loop over samples computes it),
    not psg's own refusal raised inside vmap (a :class:`~psg_core.errors.PsgError`, which must reach
    the caller as it is) or another error."""
    return not isinstance(err, PsgError) and any(sign in str(err) for sign in VMAP_LIMITS)


#: The message of torch.func's refusal to transform an ``autograd.Function`` written without
#: ``setup_context`` (Hugging Face's RecurrentGemma and SEW-D run such functions).
_NO_SETUP_CONTEXT = "must override the setup_context staticmethod"


def is_transform_limit(err: RuntimeError) -> bool:
    """Whether ``err`` is torch.func's refusal to transform the layer at all (an
    ``autograd.Function`` without ``setup_context``), which a loop over samples differentiated by
    autograd computes."""
    return not isinstance(err, PsgError) and _NO_SETUP_CONTEXT in str(err)


def _own_rows(outputs: Sequence[torch.Tensor], backprops: Sequence[torch.Tensor | None],
              out_dims: Sequence[tuple[int, int]], samples: int, K: int) -> list[torch.Tensor]:
    """Per output, ``(N, *output.shape)``: sample n's slice holds the gradient of sample n's rows
    and zeros elsewhere (its cotangent for a vector-Jacobian product of the whole batch's call)."""
    eye = None
    cotangents = []
    for out, bp, (dim, merged) in zip(outputs, backprops, out_dims):
        if bp is None:
            cotangents.append(torch.zeros((samples, *out.shape), dtype=out.dtype, device=out.device))
            continue
        if bp.shape != out.shape:
            raise ValueError(f"run again on the batch it returns shape {tuple(out.shape)} where the forward "
                             f"pass's output holds {tuple(bp.shape)}")
        if eye is None:
            eye = torch.eye(samples, dtype=bp.dtype, device=bp.device)
        per = fold_rows(bp.movedim(dim, 0), K * merged)  # (N, K*m, ...)
        own = eye.view(samples, samples, *[1] * (per.dim() - 1)) * per  # (N, N, K*m, ...): sample n's rows
        cotangents.append(own.flatten(1, 2).movedim(1, dim + 1))
    return cotangents


def _replays(out: torch.Tensor, kept: torch.Tensor) -> bool:
    """Whether a replayed output equals the one the forward pass returned, to 64 units of the
    coarser dtype's rounding of its largest entry (the replay may run in the parameters'
    precision)."""
    if out.shape != kept.shape:
        return False
    coarse = min(torch.finfo(out.dtype).eps, 1.0) if out.is_floating_point() else 0.0
    coarse = max(coarse, torch.finfo(kept.dtype).eps if kept.is_floating_point() else 0.0)
    a, b = out.detach().double(), kept.double()
    # (a mask drawn otherwise differs by whole entries: 5% of the largest at most for half precision)
    return bool(((a - b).abs() <= min(64 * coarse, 0.05) * (b.abs().max() + 1e-30)).all())


def _num_samples(inputs: list[Any], in_dims: Sequence[int | None], bps: list[torch.Tensor | None]) -> int:
    for b in bps:
        if b is not None:
            return int(b.shape[0])
    for value, dim in zip(inputs, in_dims):
        if dim is not None and isinstance(value, torch.Tensor):
            return int(value.shape[0])
    return 0


def _own_named_parameters(layer: nn.Module) -> dict[str, nn.Parameter]:
    """The layer's own parameters by name, a parametrized tensor's originals included
    (``parametrizations.weight.original0``: functional_call swaps them in, and the parametrization
    computes the weight from each sample's copy)."""
    if is_unit(layer):  # a unit owns its whole subtree (psg_core.support.unit_module)
        return dict(layer.named_parameters())
    named = dict(layer.named_parameters(recurse=False))
    if parametrized(layer):
        lists = cast(nn.Module, layer.parametrizations)
        named.update((f"parametrizations.{name}", p) for name, p in lists.named_parameters())
    return named
