"""What the hook-based backends (hooks, ghost) record of a layer call, and how they turn its
output gradients into per-sample gradients.

Both install a forward hook on every module with trainable parameters; the hook calls
:func:`capture_call`, which decides the call's batch dimension and rows (a grad sampler may
count rows itself, e.g. ``EmbeddingBag`` with offsets), keeps detached inputs and names the
outputs whose gradients the backend then asks for. :func:`call_grad_samples` computes the
layer's per-sample gradients from those: its registered grad sampler, or the per-layer
``torch.func`` fallback.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from psg_core._layout import ALWAYS_BATCH_FIRST
from psg_core.errors import PsgError, UnsupportedModuleError
from psg_core.grad_sample.experts import routed_experts_grad_sample
from psg_core.grad_sample.functorch_fallback import functorch_layer_grad_sample
from psg_core.grad_sample.registry import GRAD_SAMPLERS, GradSamplerEntry
from psg_core.precision import layer_dtype, no_autocast, to_compute
from psg_core.provenance import (GROUPED, MIXED, PERMUTED, UNKNOWN, active_tracker, arg_versions, is_rowwise,
                                 whole_view)
from psg_core.support import CallState, is_cache, is_unit, parametrized, rng_changed, without_fresh_caches

__all__ = ["LayerCall", "call_grad_samples", "capture_call", "runs_in_fallback", "separate_outputs"]


def _detached(value: Any) -> Any:
    # (a tensor outside autograd's graph is its own detached self: no op to dispatch)
    return value.detach() if isinstance(value, torch.Tensor) and value.requires_grad else value


@dataclass
class LayerCall:
    """One forward call of a hooked layer."""

    layer: nn.Module
    #: the call's positional and keyword arguments, tensors detached.
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    #: the layer's grad sampler (None: the torch.func fallback).
    entry: GradSamplerEntry | None
    batch_dim: int
    #: N*K rows of the call: counted by the sampler, else the first tensor argument's batch
    #: dimension; None when neither tells.
    rows: int | None
    #: the sampler counted the rows (they are not the first input's batch dimension).
    custom_rows: bool
    #: how many outputs require grad (the gradients the backend will get).
    num_outputs: int
    #: entries of the batch axis per row in the layer's own tensors (a view merged the batch with
    #: the axes after it); the record's args are split back to rows, and so must the gradients be.
    merged: int = 1
    #: entries per batch row left merged in the layer's own tensors, for a sampler whose layer
    #: fixes its axes (a convolution or a norm on ``(N*T, C, ...)`` frames): it takes them as
    #: ``row_factor`` more copies of each row (K times as many), since an extra axis would be
    #: read as channels.
    row_factor: int = 1
    #: the versions of the tensor arguments when the call was captured (see :meth:`check_unchanged`).
    versions: tuple[int, ...] = ()
    #: for the torch.func fallback (no grad sampler): ``(batch axis, entries per row)`` of each
    #: output with a gradient, where the forward pass put it (a layer may move the batch, reduce an
    #: axis before it, or return rows merged with another axis); empty: ``(batch_dim, 1)``.
    output_dims: tuple[tuple[int, int], ...] = ()
    #: for the torch.func fallback: each tensor among the call's flattened ``(args, kwargs)`` as the
    #: tracker followed it: None batch-free, else ``(axis, entries per row)``, the axis UNKNOWN where
    #: it was not followed (judged by its size); empty: no tracker, every tensor judged by its size.
    input_dims: tuple[tuple[int, int] | None, ...] = ()
    #: per hooked output: the shape of an output whose gradient is taken at its base (see
    #: :func:`_grad_target`), else None; empty: every gradient is taken at the output itself.
    output_shapes: tuple[torch.Size | None, ...] = ()
    #: for the torch.func fallback: the positions of the hooked outputs among the call's flattened
    #: output (an integer index or a batch-free tensor returned beside them is not hooked).
    output_index: tuple[int, ...] = ()
    #: for the torch.func fallback: the state the call began with (see
    #: :func:`~psg_core.support.call_state`), which each sample's run of the call is given.
    state: CallState = CallState()
    #: the layer's ``weight`` or ``bias`` is computed from its parameters at each call (see
    #: :func:`_computed_weight`): no sampler or ghost norm of the layer's type applies (they would
    #: give the computed tensor's gradient, which no parameter receives).
    computed_weight: bool = False

    def output_grads(self, grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """The gradients of the call's outputs, from those of the tensors that were hooked (an
        output's base has its elements in the same order: a view of its shape gives them)."""
        if not self.output_shapes:
            return grads
        return [g if g is None or shape is None else g.view(shape) if g.is_contiguous() else g.reshape(shape)
                for g, shape in zip(grads, self.output_shapes)]

    def check_unchanged(self, where: str) -> None:
        """Raises when an op after the call changed one of its tensor arguments in place: the
        per-sample gradients would be computed from values the call never saw."""
        now = tuple(a._version for a in self.args if isinstance(a, torch.Tensor))  # (no tracker by now)
        if now != self.versions:
            raise UnsupportedModuleError(
                f"{where}: the input of {type(self.layer).__qualname__} was modified in place after the "
                "call (by a later op), so its per-sample gradients cannot be computed from it; clone it "
                "before modifying it (x = x.clone())")

    def unmerge(self, grad: torch.Tensor | None) -> torch.Tensor | None:
        """An output gradient in the record's layout (the batch split from the axes it was merged with)."""
        if grad is None or self.merged == 1:
            return grad
        return _unmerge(grad, self.batch_dim, self.merged)


def _unmerge(tensor: torch.Tensor, dim: int, merged: int) -> torch.Tensor:
    return tensor.unflatten(dim, (tensor.shape[dim] // merged, merged))


def capture_call(layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any,
                 batch_dim: int) -> tuple[LayerCall, list[torch.Tensor]] | None:
    """The call's record and the tensors whose gradients to take (its outputs that require grad,
    or their stand-ins, see :func:`_grad_target`), or None when there are none (nothing to
    backpropagate). A call with several such outputs gets them replaced first (see
    :func:`separate_outputs`, which the forward hook runs before this).

    ``batch_dim`` is the model's; layers marked always-batch-first (by class or by their grad
    sampler) get 0. The record holds no output: a gradient hook on an output that refers back to
    it would be a reference cycle through autograd's C++ nodes, which the garbage collector
    cannot break, so a forward pass without a backward would never be freed.

    >>> layer = nn.Linear(3, 2)
    >>> x = torch.randn(4, 5, 3)
    >>> call, outputs = capture_call(layer, (x,), {}, layer(x), batch_dim=1)
    >>> call.rows, call.batch_dim, call.custom_rows, len(outputs)
    (5, 1, False, 1)
    """
    flat = [output] if isinstance(output, torch.Tensor) else tree_flatten(output)[0]
    index = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not index:
        return None
    tracker = active_tracker()
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if tracker is not None:
        # Only the outputs that carry the batch have per-row gradients here. One computed from the
        # parameters without the batch (called on broadcast position ids or a bucket matrix; BART's
        # position table, made from the batch's shape only; WavLM's relative-position bias, returned
        # beside its batched output) stays batch-free, and the tracker handles where it meets the
        # batch: hooking it too would count that path twice.
        index = [i for i in index if tracker.is_batched(flat[i])]
        if not index:
            return None
        first = next((a for a in args if isinstance(a, torch.Tensor) and tracker.is_batched(a)), first)
    entry = GRAD_SAMPLERS.lookup(layer)
    computed = entry is not None and _computed_weight(layer)
    if computed:
        entry = None  # the torch.func fallback differentiates the parameters it is computed from
    if entry is None and tracker is not None and tracker.met_own(layer):
        return None  # its own parameters met the batch in pointwise ops only: meeting points give theirs
    if entry is None and (first is None or (tracker is not None and not tracker.is_batched(first))):
        # The torch.func fallback takes keyword inputs too (a model owning a parameter, called with
        # input_values=...): its rows are those of the first batched one.
        first = next((v for v in kwargs.values() if isinstance(v, torch.Tensor)
                      and (tracker is None or tracker.is_batched(v))), first)
    # (axis, entries per row) of the first input as the tracker followed it (one lookup)
    state = tracker.state(first) if tracker is not None and first is not None else None
    if tracker is not None and state is not None and state[0] in (MIXED, GROUPED, PERMUTED):
        # Rows whose values mix samples, or rows a mask picked from every sample: refused.
        tracker.check_rows(cast(torch.Tensor, first), f"module {tracker.current_module()}")
    if getattr(type(layer), ALWAYS_BATCH_FIRST, False) or (entry is not None and entry.batch_first_only):
        batch_dim = 0
    elif state is not None and state[0] >= 0:
        batch_dim = state[0]  # where the batch really is (e.g. a time-major model's last step)
    merged = 1 if state is None else int(state[1])
    if merged > 1 and tracker is not None and tracker.merged(flat[index[0]]) != merged:
        # The output does not keep the merge (an EmbeddingBag pools flattened tokens into bags):
        # the layer's rows are its own (its sampler counts them), not split tokens.
        merged = 1
    entries = 1  # per batch row, on the first input's batch axis, left merged for the fallback
    row_factor = 1
    if merged > 1 and tracker is not None and entry is None:
        # The torch.func fallback runs the layer on each sample's merged rows as they are (it may
        # reshape them itself: a router's (N*T, d) tokens); input_dims and output_dims say how many.
        entries, merged = merged, 1
    elif merged > 1 and tracker is not None and entry is not None and entry.batch_first_only:
        # A layer that fixes its axes ((rows, channels, ...): convolutions, batch/group/instance
        # norms) cannot take the batch split from the frames merged into it: its sampler sees the
        # merged rows, a sample's K*merged of them taken as its copies.
        entries = row_factor = merged
        merged = 1
    elif merged > 1 and tracker is not None:
        # A view merged the batch with the axes after it ((N*T, d) from (N, T, d)): split them
        # again, so the sampler sees the batch's rows.
        args = tuple(_unmerge(a, batch_dim, merged) if isinstance(a, torch.Tensor) and tracker.is_batched(a)
                     and tracker.batch_dim(a) == batch_dim and tracker.merged(a) == merged else a for a in args)
        first = args[0] if isinstance(args[0], torch.Tensor) else first
    versions = arg_versions(args)
    if tracker is not None and tracker.modified_in_call(layer, versions):
        raise UnsupportedModuleError(
            f"per-sample gradients: module {tracker.current_module()} modifies its input in place; its "
            "per-sample gradients are computed from the input it was called with, which no longer "
            "exists. Clone the input before modifying it (x = x.clone()) in the module's forward")
    custom = entry.count_rows(layer, args, kwargs) if entry is not None else None
    if custom is not None:
        custom //= row_factor
    rows = custom
    if rows is None:
        rows = int(first.shape[batch_dim]) // entries if first is not None and first.dim() > batch_dim else None
    call = LayerCall(layer=layer, args=tuple(_detached(a) for a in args),
                     kwargs={k: _detached(v) for k, v in kwargs.items()}, entry=entry,
                     batch_dim=batch_dim, rows=rows, custom_rows=custom is not None,
                     num_outputs=len(index), merged=merged, row_factor=row_factor,
                     versions=versions, computed_weight=computed,
                     state=_call_state(tracker, layer) if entry is None and tracker is not None else CallState(),
                     output_index=tuple(index) if entry is None else (),
                     output_dims=() if entry is not None else _output_dims(tracker, [flat[i] for i in index],
                                                                           batch_dim),
                     input_dims=() if entry is not None else _input_dims(tracker, args, kwargs, rows))
    outputs = [flat[i] for i in index]
    if call.state.rng is not None:  # a random call: its replay is checked against what it returned
        call.state = call.state._replace(returned=tuple(t.detach().clone() for t in outputs))  # (before any in-place op)
    if all(t._base is None for t in outputs):
        return call, outputs
    targets = [_grad_target(t, tracker) for t in outputs]
    if any(target is not t for target, t in zip(targets, outputs)):
        call.output_shapes = tuple(None if target is t else t.shape for target, t in zip(targets, outputs))
    return call, targets


def _call_state(tracker: Any, layer: nn.Module) -> CallState:
    """The state the call of ``layer`` began with, its generators' states kept only where the call
    drew random numbers (dropout in training mode: its per-sample gradients replay the draws)."""
    state: CallState = tracker.state_of_call(layer)
    if state.rng is not None and not rng_changed(state.rng):
        state = state._replace(rng=None)
    return state


def runs_whole(layer: nn.Module) -> bool:
    """Whether the hooks and ghost backends may differentiate ``layer``'s whole call again per
    sample (no grad sampler, a unit, a row-wise module, a weight computed from other parameters):
    the batch tracker's ``keeps_state``, which keeps the state each such call begins with.

    >>> runs_whole(nn.Linear(2, 2)), runs_whole(nn.Module())
    (False, True)
    """
    return GRAD_SAMPLERS.lookup(layer) is None or is_unit(layer) or is_rowwise(layer) or _computed_weight(layer)


def runs_in_fallback(layer: nn.Module) -> bool:
    """Whether the hooks and ghost backends would compute ``layer``'s own per-sample gradients with
    the per-layer ``torch.func`` fallback (no grad sampler, not a unit, no weight computed from
    other parameters): the batch tracker's ``meets_own``, which spares such a layer the fallback
    where its parameters meet the batch in pointwise ops only (a layer scale, an RMSNorm's weight).

    >>> runs_in_fallback(nn.Linear(2, 2)), runs_in_fallback(nn.Module())
    (False, True)
    """
    return GRAD_SAMPLERS.lookup(layer) is None and not is_unit(layer) and not _computed_weight(layer) \
        and not is_rowwise(layer)


def separate_outputs(output: Any) -> Any:
    """``output`` with each of its tensors that require grad copied, when there are several (None
    when there is at most one: nothing to replace). A forward hook returns it for the module's output.

    The gradient that reaches an output tensor includes the paths through the layer's other
    outputs computed from it (``nn.LSTMCell`` returns ``(h, c)`` with ``h = o * tanh(c)``): the
    per-sample gradient, a vector-Jacobian product of every output with its gradient, would count
    those paths twice. A copy receives only what the rest of the model sends it.
    """
    if isinstance(output, torch.Tensor):
        return None
    flat, spec = tree_flatten(output)
    index = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
    tracker = active_tracker()
    if tracker is not None:  # only the batched ones are captured (see capture_call)
        index = [i for i in index if tracker.is_batched(flat[i])]
    if len(index) < 2:
        return None
    for i in index:
        copy = flat[i].clone()
        if tracker is not None:
            tracker.same_rows(copy, flat[i])
        flat[i] = copy
    return tree_unflatten(flat, spec)


def _grad_target(output: torch.Tensor, tracker: Any) -> torch.Tensor:
    """Where to take ``output``'s gradient: its base when it is a view of the whole of a tensor
    that only the op which made it has seen (``F.linear`` on a 3-D input returns a view of its 2-D
    matrix product), else itself.

    A hook on such a view is lost when a later op changes the view in place (``out += residual``,
    ``nn.ReLU(inplace=True)``): autograd moves the view onto a new node, and the old one, which
    the hook and the gradient edge name, is never reached, so the layer would get no gradient.
    The base keeps its node, and the gradient reaching it is the gradient of the layer's output as
    the layer returned it, in the same element order. A base the forward pass handled itself (the
    tracker followed it) might feed other ops too: the view itself is hooked then."""
    base = output._base
    if (base is None or base.grad_fn is None or tracker is None or tracker.batch_dim(base) is not None
            or not whole_view(output, base)):
        return output
    return base


def _computed_weight(layer: nn.Module) -> bool:
    """Whether the layer's ``weight`` or ``bias`` is a tensor computed from its parameters before
    each call rather than a parameter (``torch.nn.utils.weight_norm`` and ``spectral_norm`` set
    ``weight`` from ``weight_g``/``weight_v`` or ``weight_orig``): a grad sampler would compute the
    computed tensor's per-sample gradient, which no parameter receives."""
    if parametrized(layer):
        return True  # torch.nn.utils.parametrizations: computed from its originals at every access
    attributes = layer.__dict__  # a parameter lives in _parameters; a computed weight is an attribute
    if "weight" not in attributes and "bias" not in attributes:
        return False
    for name in ("weight", "bias"):
        value = attributes.get(name)
        if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter) and value.requires_grad:
            return True
    return False


def _input_dims(tracker: Any, args: tuple[Any, ...], kwargs: dict[str, Any], rows: int | None
                ) -> tuple[tuple[int, int] | None, ...]:
    """For the torch.func fallback: where the batch is in each of the call's tensors, as followed
    (a batch-free tensor whose size on the batch dimension happens to equal N*K is not split).

    A batch-free tensor made of one block repeated once per batch row (WavLM's position bias,
    ``bias.repeat(B, 1, 1, 1).view(B*H, T, T)``) is split like a batched one: a sample's forward
    alone builds one block per row of its own.

    Tensors whose values mix samples are refused here: the fallback would run each sample on rows
    the forward pass computed from other samples."""
    if tracker is None:
        return ()
    dims: list[tuple[int, int] | None] = []
    for value in tree_flatten((args, kwargs))[0]:
        axis = tracker.batch_dim(value) if isinstance(value, torch.Tensor) else None
        if axis is None:
            tiles = tracker.tiles(value) if isinstance(value, torch.Tensor) else None
            dims.append((0, tiles[1]) if tiles is not None and tiles[0] == rows else None)
            continue
        if axis in (MIXED, GROUPED, PERMUTED):
            tracker.check_rows(value, f"module {tracker.current_module()}")
        dims.append((UNKNOWN, 1) if axis < 0 else (axis, tracker.merged(value)))  # UNKNOWN: not followed
    return tuple(dims)


def _output_dims(tracker: Any, outputs: list[torch.Tensor], batch_dim: int) -> tuple[tuple[int, int], ...]:
    """Where the forward pass put the batch in each output, and its entries per row (the call's
    ``batch_dim``, one entry, where the tracker does not know it)."""
    if tracker is None:
        return ()
    dims = []
    for out in outputs:
        axis = tracker.batch_dim(out)
        dims.append((axis, tracker.merged(out)) if axis is not None and axis >= 0 else (batch_dim, 1))
    return tuple(dims) if any(d != (batch_dim, 1) for d in dims) else ()


def _batch_state_object(call: LayerCall) -> str | None:
    """The class name of a cache among the call's inputs (transformers' ``Cache`` family: it holds
    every sample's state, so running the layer on one sample's rows with it fails or mixes them),
    but for one that held nothing for the layer when the call began (a training forward's, which
    a sample's run leaves out: see :func:`~psg_core.support.call_state`)."""
    for value in tree_flatten((call.args, call.kwargs))[0]:
        if is_cache(value) and id(value) not in call.state.fresh_caches:
            return type(value).__name__
    return None


def call_grad_samples(call: LayerCall, grads: list[torch.Tensor | None], K: int, *, where: str,
                      force_functorch: bool = False,
                      suspend: contextlib.AbstractContextManager[Any] | None = None
                      ) -> dict[torch.Tensor, torch.Tensor]:
    """``{param: (N, *param.shape)}``: the per-sample gradients of the layer's own parameters
    from its outputs' gradients ``grads`` (batch layout as captured, N*K rows).

    The grad sampler when the layer has one and a single output with a gradient, else the
    per-layer ``torch.func`` fallback (run inside ``suspend``, which should stop the backend from
    capturing the layer's re-run forward).
    """
    # Autocast leaves half-precision gradients (and maybe activations) beside fp32 parameters:
    # the per-sample arithmetic runs in the parameters' precision (psg_core.precision).
    call.check_unchanged(where)
    K *= call.row_factor
    dtype = layer_dtype(call.layer)
    grads = [to_compute(call.unmerge(g), dtype) for g in grads]
    if any(to_compute(a, dtype) is not a for a in call.args):
        call = dataclasses.replace(call, args=tuple(to_compute(a, dtype) for a in call.args))
    with no_autocast():
        return _call_grad_samples(call, grads, K, where=where, force_functorch=force_functorch, suspend=suspend)


def _call_grad_samples(call: LayerCall, grads: list[torch.Tensor | None], K: int, *, where: str,
                       force_functorch: bool,
                       suspend: contextlib.AbstractContextManager[Any] | None) -> dict[torch.Tensor, torch.Tensor]:
    entry = None if force_functorch else call.entry
    if entry is not None and len(grads) == 1 and grads[0] is not None:
        result = entry.compute(call.layer, call.args, call.kwargs, grads[0], K, call.batch_dim)
        own = {id(p) for p in call.layer._parameters.values()}
        if all(id(t) in own for t in result):
            return result
        # The sampler's tensors are not the layer's parameters: a weight computed from others
        # before each call (torch.nn.utils.weight_norm's weight_g and weight_v): theirs come from
        # running the layer per sample, below.
    # No sampler, several outputs, or a sampler that missed the parameters: the torch.func fallback.
    if call.custom_rows:
        # torch.func splits inputs along the batch dim, which this call's rows are not.
        raise UnsupportedModuleError(
            f"{where}: {type(call.layer).__qualname__} was called with rows that are not its first "
            "input's batch dimension (e.g. EmbeddingBag with offsets); the torch.func fallback "
            "cannot split them, only the layer's grad sampler can")
    if call.rows is None:
        raise UnsupportedModuleError(
            f"{where}: {type(call.layer).__qualname__} was called without a batched tensor as its "
            "first argument, so its rows cannot be attributed to samples")
    cache = _batch_state_object(call)
    if cache is not None:
        raise UnsupportedModuleError(
            f"{where}: {type(call.layer).__qualname__} runs per sample under torch.func, but its call was given "
            f"a {cache} object, which holds state for the whole batch that one sample's run cannot use; "
            "train with the cache off (use_cache=False)")
    with suspend if suspend is not None else contextlib.nullcontext():
        if is_rowwise(call.layer) and call.input_dims and call.state.rng is None:
            # (experts that drew random numbers are replayed on the whole batch instead)
            routed = routed_experts_grad_sample(call.layer, call.args, call.kwargs, grads, K, call.rows,
                                                call.input_dims)
            if routed is not None:
                return routed
        try:
            args, kwargs = without_fresh_caches((call.args, call.kwargs), call.state)
            return functorch_layer_grad_sample(call.layer, args, kwargs, grads, K,
                                               call.batch_dim, call.rows, call.output_dims or None,
                                               call.input_dims or None, state=call.state,
                                               output_index=call.output_index or None)
        except (RuntimeError, ValueError) as err:
            if isinstance(err, PsgError):
                raise
            raise UnsupportedModuleError(
                f"{where}: {type(call.layer).__qualname__} has no grad sampler, and running it per sample "
                f"under torch.func failed ({err}); register a grad sampler for it "
                "(psg_core.register_grad_sampler) or use mode='functorch'") from err
